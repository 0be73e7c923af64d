"""DGPO and GARDO (diffrl.algorithms.losses_group, diffrl.algorithms.gardo) against their formulas written out by hand,
gradients included."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from diffrl.algorithms.catalog import get_algorithm
from diffrl.algorithms.gardo import diversity_advantages, uncertainty_gate
from diffrl.algorithms.losses import dgpo_loss, gardo_loss

D = torch.float64


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_dgpo_loss_value_and_gradient_by_hand():
    # one element per sample: e_i = (v_i - t_i)^2
    v = torch.tensor([[1.0], [2.0], [0.0], [1.0]], dtype=D, requires_grad=True)
    t = torch.zeros(4, 1, dtype=D)
    ref = torch.tensor([[0.5], [1.0], [1.0], [0.0]], dtype=D)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=D)
    loss, m = dgpo_loss(v, t, ref, adv, torch.tensor([0, 0, 1, 1]), beta=0.1, adv_clip_max=5.0)
    # e = [1, 4, 0, 1], e_ref = [0.25, 1, 1, 0]; A (e - e_ref) = [0.75, -3, -2, -2]
    w0, w1 = _sigmoid(0.1 * (0.75 - 3) / 2), _sigmoid(0.1 * (-2 - 2) / 2)
    expected = (w0 * (1 * 1 - 1 * 4) + w1 * (2 * 0 - 2 * 1)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # d/dv_i = w_g A_i 2 v_i / b
    by_hand = [w0 * 1 * 2 * 1 / 4, w0 * -1 * 2 * 2 / 4, w1 * 2 * 2 * 0 / 4, w1 * -2 * 2 * 1 / 4]
    torch.testing.assert_close(v.grad.flatten(), torch.tensor(by_hand, dtype=D))
    assert m["actor/group_weight"].item() == pytest.approx((w0 + w1) / 2)
    assert m["actor/dsm_loss"].item() == pytest.approx(1.5) and m["actor/ref_dsm_loss"].item() == pytest.approx(0.5625)
    assert m["actor/pg_clipfrac"].item() == 0.0 and m["actor/kl_loss"].item() == 0.0


def test_dgpo_gradient_is_the_group_preference_loss_gradient_over_beta():
    """mean_g -log sigmoid(-beta/|g| sum_g A (e - e_ref)), the paper's loss, has beta times DGPO's gradient."""
    g = torch.Generator().manual_seed(0)
    target, ref = torch.randn(6, 3, 2, generator=g, dtype=D), torch.randn(6, 3, 2, generator=g, dtype=D)
    v0 = target + 0.5 * torch.randn(6, 3, 2, generator=g, dtype=D)
    adv = torch.tensor([1.2, -0.4, -0.8, 0.3, 0.9, -1.2], dtype=D)  # sums to 0 in each group
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    beta = 2.0
    v = v0.clone().requires_grad_(True)
    dgpo_loss(v, target, ref, adv, groups, beta=beta, adv_clip_max=5.0)[0].backward()
    w = v0.clone().requires_grad_(True)
    err = ((w - target) ** 2).mean((1, 2))
    ref_err = ((ref - target) ** 2).mean((1, 2))
    s = torch.stack([beta * (adv * (err - ref_err))[groups == k].mean() for k in (0, 1)])
    (-F.logsigmoid(-s)).mean().backward()
    torch.testing.assert_close(v.grad * beta, w.grad)


def test_dgpo_clip_stops_the_gradient_of_samples_that_moved_past_the_trust_region():
    v = torch.tensor([[1.0], [1.0]], dtype=D, requires_grad=True)
    t = torch.zeros(2, 1, dtype=D)
    # e = [1, 1]; e_old = [1.5, 1.0]: rho = [exp(0.5), 1]; sample 0 has A > 0 and rho > 1 + 0.01: clipped
    old = torch.tensor([[math.sqrt(1.5)], [1.0]], dtype=D)
    adv = torch.tensor([1.0, -1.0], dtype=D)
    loss, m = dgpo_loss(
        v, t, t, adv, torch.tensor([0, 0]), beta=1.0, adv_clip_max=5.0, old_velocity=old, clip_ratio=0.01
    )
    loss.backward()
    w = _sigmoid((1 * 1 - 1 * 1) / 2)  # = 1/2
    assert loss.item() == pytest.approx((w * 1 - w * 1) / 2)  # the clipped sample keeps its value
    torch.testing.assert_close(v.grad.flatten(), torch.tensor([0.0, w * -1 * 2 / 2], dtype=D))
    assert m["actor/pg_clipfrac"].item() == 0.5
    # rho < 1 - eps clips a sample with A < 0 (sample 0 here), not one with A > 0 (sample 1)
    v.grad = None
    loss, m = dgpo_loss(
        v, t, t, -adv, torch.tensor([0, 0]), beta=1.0, adv_clip_max=5.0, old_velocity=old * 0.5, clip_ratio=0.01
    )
    loss.backward()
    assert m["actor/pg_clipfrac"].item() == 0.5
    torch.testing.assert_close(v.grad.flatten(), torch.tensor([0.0, w * 1 * 2 / 2], dtype=D))


def test_dgpo_kl_term_and_advantage_clamp():
    v = torch.tensor([[1.0, 3.0]], dtype=D, requires_grad=True)
    t = torch.zeros(1, 2, dtype=D)
    kl_ref = torch.tensor([[0.0, 1.0]], dtype=D)
    adv = torch.tensor([10.0], dtype=D)  # clamped to 2
    loss, m = dgpo_loss(v, t, t, adv, torch.tensor([0]), beta=1.0, adv_clip_max=2.0, kl_velocity=kl_ref, kl_coef=0.5)
    w = _sigmoid(2 * 5.0)  # e = (1 + 9) / 2 = 5, e_ref = 0
    assert loss.item() == pytest.approx(w * 2 * 5 + 0.5 * (1 + 4) / 2)
    assert m["actor/kl_loss"].item() == pytest.approx(2.5)
    loss.backward()
    # d/dv = w A 2 v / 2 + kl_coef 2 (v - v_kl) / 2
    torch.testing.assert_close(v.grad, torch.tensor([[w * 2 * 1 + 0.5 * 1, w * 2 * 3 + 0.5 * 2]], dtype=D))


def test_dgpo_errors():
    v, t = torch.zeros(2, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dgpo_loss(v, t, t, torch.zeros(2), torch.tensor([0, 1]), beta=0.0, adv_clip_max=5.0)
    with pytest.raises(ValueError, match="group_index must hold one group number"):
        dgpo_loss(v, t, t, torch.zeros(2), torch.tensor([0]), beta=1.0, adv_clip_max=5.0)
    with pytest.raises(ValueError, match="ref_velocity"):
        dgpo_loss(v, t, torch.zeros(2, 4), torch.zeros(2), torch.tensor([0, 1]), beta=1.0, adv_clip_max=5.0)
    with pytest.raises(ValueError, match="kl_coef > 0 needs kl_velocity"):
        dgpo_loss(v, t, t, torch.zeros(2), torch.tensor([0, 1]), beta=1.0, adv_clip_max=5.0, kl_coef=0.1)


def test_gardo_loss_value_and_gradient_by_hand():
    log_prob = torch.tensor([0.1, -0.2, 0.0], dtype=D, requires_grad=True)
    old = torch.zeros(3, dtype=D)
    adv = torch.tensor([1.0, 2.0, -1.0], dtype=D)
    std = torch.tensor([0.5, 1.0, 1.5], dtype=D).view(3, 1)
    mu = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 2.0]], dtype=D, requires_grad=True)
    ref = torch.zeros(3, 2, dtype=D)
    gate = torch.tensor([True, False, True])
    loss, m = gardo_loss(
        log_prob,
        old,
        adv,
        prev_sample_mean=mu,
        std_dev_t=std,
        clip_ratio=0.2,
        adv_clip_max=5.0,
        ref_prev_sample_mean=ref,
        kl_gate=gate,
        kl_coef=0.1,
    )
    r = [math.exp(0.1), math.exp(-0.2), 1.0]
    clip = [min(max(x, 0.8), 1.2) for x in r]
    scale = [0.5 / 1.0, 1.0 / 1.0, 1.5 / 1.0]  # std / mean(std)
    per = [s * max(-a * x, -a * c) for s, a, x, c in zip(scale, [1.0, 2.0, -1.0], r, clip)]
    kl = [(1.0 + 0.0) / 2 / (2 * 0.25), None, (4.0 + 4.0) / 2 / (2 * 2.25)]
    expected = sum(per) / 3 + 0.1 * (kl[0] + kl[2]) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["actor/kl_loss"].item() == pytest.approx((kl[0] + kl[2]) / 2)
    assert m["actor/kl_gated_frac"].item() == pytest.approx(2 / 3)
    loss.backward()
    # d/dlp: -A r scale / b where the unclipped branch is active (r within the clip for all three here)
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([-a * x * s / 3 for a, x, s in zip([1.0, 2.0, -1.0], r, scale)], dtype=D)
    )
    # d/dmu_i of kl_coef mean_gated KL: kl_coef / n_gated * (mu - ref) / (std^2 * elements), 0 for the ungated
    grad_mu = torch.tensor([[0.1 / 2 * 1 / (0.25 * 2), 0.0], [0.0, 0.0], [0.1 / 2 * 2 / (2.25 * 2)] * 2], dtype=D)
    torch.testing.assert_close(mu.grad, grad_mu)


def test_gardo_without_gate_or_gated_samples():
    lp, old, adv = torch.zeros(2, dtype=D), torch.zeros(2, dtype=D), torch.tensor([1.0, -1.0], dtype=D)
    mu, ref = torch.ones(2, 2, dtype=D), torch.zeros(2, 2, dtype=D)
    std = torch.ones(2, dtype=D)
    kwargs = dict(prev_sample_mean=mu, std_dev_t=std, clip_ratio=0.2, adv_clip_max=5.0, ref_prev_sample_mean=ref)
    loss_all, m = gardo_loss(lp, old, adv, kl_coef=1.0, **kwargs)  # no gate: every sample
    assert loss_all.item() == pytest.approx(0.5) and m["actor/kl_gated_frac"].item() == 1.0
    none, m = gardo_loss(lp, old, adv, kl_coef=1.0, kl_gate=torch.tensor([False, False]), **kwargs)
    assert none.item() == 0.0 and m["actor/kl_loss"].item() == 0.0
    with pytest.raises(ValueError, match="kl_gate must hold one flag per sample"):
        gardo_loss(lp, old, adv, kl_coef=1.0, kl_gate=torch.tensor([True]), **kwargs)


def test_uncertainty_gate_by_hand():
    main = torch.tensor([4.0, 3.0, 2.0, 1.0])
    aux = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    # ranks: main [1, 2, 3, 4], aux [4, 3, 2, 1]: u = [-3, -1, 1, 3]; among u >= 0 ({1, 3}) the 0.5 quantile is 2
    assert uncertainty_gate(main, aux, 0.5).tolist() == [False, False, False, True]
    assert uncertainty_gate(main, -aux, 0.5).tolist() == [False, False, False, False]  # u = 0 everywhere
    with pytest.raises(ValueError, match="fraction must be in"):
        uncertainty_gate(main, aux, 0.0)
    # the GARDO object ranks its main reward component against the others
    gardo = get_algorithm("gardo", kl_gate_fraction=0.5, main_reward="ocr")
    components = {"aesthetic": aux[0], "ocr": main, "imagereward": aux[1]}
    assert gardo.reward_gate(components).tolist() == [False, False, False, True]


def test_diversity_advantages_by_hand():
    features = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.6, 0.8, 0.0], [5.0, 1.0, 0.0]])
    rewards = torch.tensor([3.0, 1.0, 2.0, 7.0])
    # group a: cos 0 (d 1), 0.6 (d 0.4), 0.8 (d 0.2): nearest [0.4, 0.2, 0.2], mean 0.8 / 3; centred [1, -1, 0]
    out = diversity_advantages(rewards, ["a", "a", "a", "b"], features)
    torch.testing.assert_close(out, torch.tensor([1 * 0.4 / (0.8 / 3), -1.0, 0.0, 0.0], dtype=D))
