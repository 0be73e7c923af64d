"""diffrl.algorithms.advantages against hand-computed values and invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffrl.algorithms.advantages import advantage_stats, group_advantages, reward_stats

REWARDS = torch.tensor([1.0, 3.0, 2.0, 2.0, 4.0, 0.0], dtype=torch.float64)
IDS = ["a", "a", "b", "b", "c", "c"]


def test_global_std_hand_computed():
    adv = group_advantages(REWARDS, IDS, eps=1e-4)
    std = torch.tensor([1.0, 3.0, 2.0, 2.0, 4.0, 0.0], dtype=torch.float64).std(correction=0)  # sqrt(5/3)
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, 2.0, -2.0], dtype=torch.float64) / (std + 1e-4)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    assert adv.dtype == torch.float64


def test_group_std_and_dr_grpo():
    adv = group_advantages(REWARDS, torch.tensor([0, 0, 1, 1, 2, 2]), global_std=False, eps=1e-4)
    torch.testing.assert_close(
        adv, torch.tensor([-1 / 1.0001, 1 / 1.0001, 0, 0, 2 / 2.0001, -2 / 2.0001], dtype=torch.float64)
    )
    dr = group_advantages(REWARDS.float(), IDS, norm_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([-1.0, 1.0, 0.0, 0.0, 2.0, -2.0]))
    assert dr.dtype == torch.float32


def test_sample_std_per_group_closed_form_and_dance_grpo_bundle():
    """DanceGRPO's advantages: (r - group mean) / (group sample std (ddof 1) + 1e-8); the dance_grpo bundle uses it."""
    from diffrl.algorithms.catalog import get_algorithm

    rewards = torch.tensor([0.2, 0.9, 0.4, 0.7, 1.0, 0.1, 0.5, 0.5, 0.6], dtype=torch.float64)
    ids = ["a"] * 4 + ["b"] * 3 + ["c"] + ["d"]  # groups of 4, 3 and two of one sample
    expected = torch.empty_like(rewards)
    for g in sorted(set(ids)):
        rows = [i for i, x in enumerate(ids) if x == g]
        r = rewards[rows]
        n = len(rows)
        mean = sum(r.tolist()) / n
        std = (sum((v - mean) ** 2 for v in r.tolist()) / (n - 1)) ** 0.5 if n > 1 else 0.0  # undefined for one: 0
        expected[rows] = (r - mean) / (std + 1e-8)
    dance = get_algorithm("dance_grpo")
    assert (dance.global_std, dance.adv_std_ddof, dance.adv_eps) == (False, 1, 1e-8)
    adv = group_advantages(rewards, ids, global_std=dance.global_std, eps=dance.adv_eps, ddof=dance.adv_std_ddof)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # ddof 0 at 12 samples per group: sqrt(12/11) times ddof 1's (4.4 % larger)
    twelve = torch.arange(12, dtype=torch.float64) ** 1.5
    ratio = group_advantages(twelve, ["g"] * 12, global_std=False, eps=1e-12) / group_advantages(
        twelve, ["g"] * 12, global_std=False, eps=1e-12, ddof=1
    )
    torch.testing.assert_close(ratio, torch.full((12,), (12 / 11) ** 0.5, dtype=torch.float64))
    # the batch's sample std with global_std
    glob = group_advantages(REWARDS, IDS, eps=1e-4, ddof=1)
    torch.testing.assert_close(
        glob,
        torch.tensor([-1.0, 1.0, 0.0, 0.0, 2.0, -2.0], dtype=torch.float64) / (REWARDS.std(correction=1) + 1e-4),
        rtol=0,
        atol=1e-12,
    )
    with pytest.raises(ValueError, match="ddof must be 0"):
        group_advantages(REWARDS, IDS, ddof=2)


def test_stats():
    stats = reward_stats(REWARDS, IDS)
    assert stats["critic/rewards/mean"] == pytest.approx(2.0)
    assert stats["critic/rewards/max"] == 4.0 and stats["critic/rewards/min"] == 0.0
    assert stats["critic/rewards/zero_std_ratio"] == pytest.approx(1 / 3)
    assert stats["critic/rewards/std_mean"] == pytest.approx((1 + 0 + 2) / 3)
    assert stats["critic/rewards/group_size"] == 2.0
    assert reward_stats(torch.tensor([0.1, 0.1, 0.1]), ["p"] * 3)["critic/rewards/zero_std_ratio"] == 1.0
    a = advantage_stats(torch.tensor([-1.0, 0.5, 0.5]))
    assert a == {"critic/advantages/mean": 0.0, "critic/advantages/max": 0.5, "critic/advantages/min": -1.0}


def test_errors():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(REWARDS, IDS[:3])


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=24),
    num_groups=st.integers(1, 4),
    shift=st.floats(-1000, 1000),
    global_std=st.booleans(),
)
def test_sum_zero_per_group_and_shift_invariant(rewards, num_groups, shift, global_std):
    r = torch.tensor(rewards, dtype=torch.float64)
    ids = [i % num_groups for i in range(len(rewards))]
    adv = group_advantages(r, ids, global_std=global_std)
    for g in set(ids):
        members = torch.tensor([i == g for i in ids])
        assert abs(float(adv[members].sum())) < 1e-6 * max(1.0, float(adv.abs().max()))
    shifted = group_advantages(r + shift, ids, global_std=global_std)
    torch.testing.assert_close(shifted, adv, rtol=1e-6, atol=1e-6)
