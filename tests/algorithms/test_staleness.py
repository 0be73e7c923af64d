"""Asynchronous training's off-policy accounting and its corrected loss, against hand-computed numbers.

One batch of four samples, trained while the trainer is at version 5: a group g0 sampled at version 4 (staleness 1) and
a group g1 sampled at version 3 (staleness 2). The loss is Flow-GRPO's clipped surrogate against the proximal policy
(the trainer's weights before the update: "old"), each sample weighted by its behaviour correction, a function of
pi_prox / pi_behav (docs/algorithms.md, "Off-policy correction"):

    sample group staleness prox/behav theta/prox  A     PPO term (clip 0.2)     tis w (cap 2)  mask w (t 2)
    0      g0    1         1.5        1.1         +1    max(-1.1, -1.1) = -1.1  1.5            1
    1      g0    1         3.0        1.5         -1    max(1.5, 1.2)   =  1.5  2 (truncated)  0
    2      g1    2         4.0        0.7         -2    max(1.4, 1.6)   =  1.6  2 (truncated)  0
    3      g1    2         0.5        1.0         +0.5  max(-0.5, -0.5) = -0.5  0.5            1
"""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms.losses import flow_grpo_loss
from diffrl.algorithms.staleness import fresh_groups, sample_staleness, staleness_stats
from diffrl.configs.train import TrainConfig
from diffrl.engines.train.policy_loss import correction_stats, correction_weights

GROUPS = ["g0", "g0", "g1", "g1"]
VERSIONS = torch.tensor([4, 4, 3, 3])
TRAINER_VERSION = 5
BEHAVIOUR = torch.tensor([-0.3, 0.2, -1.0, 0.4], dtype=torch.float64)
PROXIMAL = BEHAVIOUR + torch.tensor([1.5, 3.0, 4.0, 0.5], dtype=torch.float64).log()
ADVANTAGES = torch.tensor([1.0, -1.0, -2.0, 0.5], dtype=torch.float64)
POLICY_RATIO = torch.tensor([1.1, 1.5, 0.7, 1.0], dtype=torch.float64)


def _corrected_loss(rows: list[int], correction: str):
    """The trainer's composition: behaviour weights from (proximal, behaviour), the PPO ratio against the proximal."""
    cfg = TrainConfig(rollout_correction=correction, is_cap=2.0, rs_threshold=2.0)
    log_prob = (PROXIMAL + POLICY_RATIO.log())[rows].clone().requires_grad_(True)
    weights = correction_weights(PROXIMAL[rows], BEHAVIOUR[rows], cfg)
    loss, metrics = flow_grpo_loss(
        log_prob, PROXIMAL[rows], ADVANTAGES[rows], clip_ratio=0.2, adv_clip_max=5.0, weights=weights
    )
    loss.backward()
    return loss.detach(), log_prob.grad, weights


def test_staleness_and_whole_stale_groups_are_dropped():
    staleness = sample_staleness(VERSIONS, TRAINER_VERSION)
    assert staleness.tolist() == [1, 1, 2, 2]
    assert fresh_groups(staleness, GROUPS, 1).tolist() == [True, True, False, False]
    assert fresh_groups(staleness, GROUPS, 2).tolist() == [True, True, True, True]
    assert fresh_groups(staleness, GROUPS, 0).tolist() == [False] * 4
    # a group with one stale sample goes whole (its advantages are relative to all of its samples)
    assert fresh_groups(torch.tensor([1, 2, 0, 0]), GROUPS, 1).tolist() == [False, False, True, True]
    kept = fresh_groups(staleness, GROUPS, 1)
    assert staleness_stats(staleness, kept) == {
        "async/staleness_mean": 1.0,
        "async/staleness_max": 1.0,
        "async/dropped": 2.0,
    }
    assert staleness_stats(staleness, torch.ones(4, dtype=torch.bool))["async/staleness_mean"] == 1.5
    assert staleness_stats(staleness, torch.zeros(4, dtype=torch.bool))["async/dropped"] == 4.0
    # rows kept from a step that a resume from an older checkpoint trains again: their distance counts too
    assert sample_staleness(torch.tensor([6, 5]), 5).tolist() == [1, 0]
    with pytest.raises(ValueError, match="max_staleness"):
        fresh_groups(staleness, GROUPS, -1)


def test_corrected_loss_at_staleness_1():
    """max_staleness 1: g1 (staleness 2) is dropped; g0 trains with tis weights (1.5, 2)."""
    rows = fresh_groups(sample_staleness(VERSIONS, TRAINER_VERSION), GROUPS, 1).nonzero().flatten().tolist()
    assert rows == [0, 1]
    loss, grad, weights = _corrected_loss(rows, "tis")
    torch.testing.assert_close(weights, torch.tensor([1.5, 2.0]))  # fp32, as the trainer makes them
    # mean(1.5 x -1.1, 2 x 1.5) = (-1.65 + 3.0) / 2
    assert math.isclose(float(loss), 0.675, rel_tol=1e-6)  # fp32 weights
    # d/dlog_prob of w x (-A r) / B on the unclipped branches: -1 x 1.1 x 1.5 / 2 and +1 x 1.5 x 2 / 2
    torch.testing.assert_close(grad, torch.tensor([-0.825, 1.5], dtype=torch.float64), rtol=1e-6, atol=0)


def test_corrected_loss_at_staleness_2():
    """max_staleness 2: all four train; sample 2's clipped term has no gradient."""
    rows = fresh_groups(sample_staleness(VERSIONS, TRAINER_VERSION), GROUPS, 2).nonzero().flatten().tolist()
    assert rows == [0, 1, 2, 3]
    loss, grad, _ = _corrected_loss(rows, "tis")
    # mean(-1.65, 3.0, 2 x 1.6, 0.5 x -0.5) = 4.3 / 4
    assert math.isclose(float(loss), 1.075, rel_tol=1e-6)  # fp32 weights
    torch.testing.assert_close(
        grad, torch.tensor([-0.4125, 0.75, 0.0, -0.0625], dtype=torch.float64), rtol=1e-6, atol=0
    )
    loss, grad, weights = _corrected_loss(rows, "mask")  # ratios 3 and 4 are outside [1/2, 2]; 0.5 is on its edge
    assert weights.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert math.isclose(float(loss), (-1.1 - 0.5) / 4, rel_tol=1e-6)  # fp32 weights
    torch.testing.assert_close(grad, torch.tensor([-0.275, 0.0, 0.0, -0.125], dtype=torch.float64), rtol=1e-6, atol=0)


def test_correction_statistics():
    mask = torch.tensor([True, True, True, True])
    tis = correction_stats(PROXIMAL, BEHAVIOUR, mask, TrainConfig(rollout_correction="tis", is_cap=2.0))
    assert tis["rollout_corr/ratio_min"] == pytest.approx(0.5, rel=1e-12)
    assert tis["rollout_corr/ratio_max"] == pytest.approx(4.0, rel=1e-12)
    assert tis["rollout_corr/ratio_mean"] == pytest.approx(2.25, rel=1e-12)
    assert tis["rollout_corr/ratio_corrected"] == 0.5  # 3 and 4 truncated to the cap
    masked = correction_stats(PROXIMAL, BEHAVIOUR, mask, TrainConfig(rollout_correction="mask", rs_threshold=2.0))
    assert masked["rollout_corr/ratio_corrected"] == 0.5  # 3 and 4 dropped, 0.5 kept on the edge
    some = correction_stats(
        PROXIMAL, BEHAVIOUR, torch.tensor([True, False, False, True]), TrainConfig(rollout_correction="tis")
    )
    assert (
        some["rollout_corr/ratio_mean"] == pytest.approx(1.0, rel=1e-12) and some["rollout_corr/ratio_corrected"] == 0
    )
    assert correction_stats(PROXIMAL, BEHAVIOUR, mask, TrainConfig()) == {}  # correction off: nothing logged
