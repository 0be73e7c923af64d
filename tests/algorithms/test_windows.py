"""diffrl.algorithms.windows: each kind's window, determinism, per-sample independence, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffrl.algorithms.windows import WindowPolicy, ends_at_last_step, sample_windows

SEEDS = torch.arange(100, 108, dtype=torch.int64)


def test_all_but_last():
    w = sample_windows(WindowPolicy("all_but_last"), 10, SEEDS, step=3)
    assert w.size == 9 and torch.all(w.starts == 0) and w.trained.shape == (8, 9) and w.trained.all()
    mask = w.stochastic_mask(10)
    assert mask[:, :9].all() and not mask[:, 9].any()


def test_random_start_per_sample_in_range_and_batch_independent():
    policy = WindowPolicy("random_start", size=2, start_range=(0, 4))
    w = sample_windows(policy, 10, SEEDS, step=0)
    assert w.size == 2 and ((w.starts >= 0) & (w.starts < 4)).all() and w.trained.all()
    alone = sample_windows(policy, 10, SEEDS[3:4], step=7)
    assert int(alone.starts[0]) == int(w.starts[3])  # keyed by the sample's seed, not position/step
    many = sample_windows(policy, 10, torch.arange(400), step=0)
    assert set(many.starts.tolist()) == {0, 1, 2, 3}


def test_mix_random_one_start_per_step():
    policy = WindowPolicy("mix_random", size=4, seed=5)
    w = sample_windows(policy, 25, SEEDS, step=11)
    assert len(set(w.starts.tolist())) == 1 and 0 <= int(w.starts[0]) <= 21
    again = sample_windows(WindowPolicy("mix_random", size=4, seed=0), 25, SEEDS[:1], step=16)
    assert int(again.starts[0]) == int(w.starts[0])  # drawn from seed + step
    starts = {int(sample_windows(policy, 25, SEEDS, step=s).starts[0]) for s in range(60)}
    assert len(starts) > 5


def test_mix_progressive_slides_and_clamps():
    policy = WindowPolicy("mix_progressive", size=4, iters_per_group=25)
    starts = [int(sample_windows(policy, 25, SEEDS, step=s).starts[0]) for s in (0, 24, 25, 50, 124, 125, 10_000)]
    assert starts == [0, 0, 4, 8, 16, 20, 21]


def test_dance_fraction_subset_per_sample():
    policy = WindowPolicy("dance_fraction", timestep_fraction=0.6)
    w = sample_windows(policy, 16, SEEDS, step=0)
    assert w.size == 16 and torch.all(w.starts == 0)
    assert torch.all(w.trained.sum(1) == round(0.6 * 16))
    assert len({tuple(row.tolist()) for row in w.trained}) > 1
    alone = sample_windows(policy, 16, SEEDS[2:3], step=9)
    assert torch.equal(alone.trained[0], w.trained[2])


def test_errors():
    with pytest.raises(ValueError, match="all_but_last"):
        WindowPolicy("nope")
    with pytest.raises(ValueError, match="size"):
        sample_windows(WindowPolicy("mix_random", size=11), 10, SEEDS, 0)
    with pytest.raises(ValueError, match="empty"):
        sample_windows(WindowPolicy("random_start", start_range=(3, 3)), 10, SEEDS, 0)
    with pytest.raises(ValueError, match="hi must be"):
        sample_windows(WindowPolicy("random_start", size=2, start_range=(0, 10)), 10, SEEDS, 0)
    with pytest.raises(ValueError, match="timestep_fraction"):
        WindowPolicy("dance_fraction", timestep_fraction=0.0)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["all_but_last", "random_start", "mix_random", "mix_progressive", "dance_fraction"]),
    num_steps=st.integers(4, 30),
    step=st.integers(0, 500),
    seed=st.integers(0, 10_000),
)
def test_deterministic_and_inside(kind, num_steps, step, seed):
    policy = WindowPolicy(kind, size=3, seed=seed)
    seeds = torch.arange(seed, seed + 5)
    a = sample_windows(policy, num_steps, seeds, step)
    b = sample_windows(policy, num_steps, seeds, step)
    assert torch.equal(a.starts, b.starts) and torch.equal(a.trained, b.trained)
    assert a.starts.dtype == torch.int64 and a.trained.dtype == torch.bool
    assert torch.all(a.starts + a.size <= num_steps) and torch.all(a.starts >= 0)
    assert a.trained.shape == (5, a.size) and a.trained.any(1).all()


def test_final_window_is_the_last_steps():
    from diffrl.algorithms.windows import WindowPolicy, sample_windows

    w = sample_windows(WindowPolicy("final", size=2), 10, torch.tensor([1, 2, 3]), step=0)
    assert w.size == 2 and w.starts.tolist() == [8, 8, 8] and bool(w.trained.all())
    with pytest.raises(ValueError, match="size 11 > num_steps 10"):
        sample_windows(WindowPolicy("final", size=11), 10, torch.tensor([1]), step=0)


@pytest.mark.parametrize(
    "policy, num_steps, ends",
    [
        (WindowPolicy("final", size=1), 4, True),
        (WindowPolicy("final", size=3), 4, True),
        (WindowPolicy("dance_fraction", timestep_fraction=0.5), 4, True),
        (WindowPolicy("all_but_last"), 4, False),
        (WindowPolicy("random_start", size=1, start_range=(3, 4)), 4, True),
        (WindowPolicy("random_start", size=4, start_range=(0, 1)), 4, True),
        (WindowPolicy("random_start", size=2, start_range=(2, None)), 4, True),
        (WindowPolicy("random_start", size=2, start_range=(1, 2)), 4, False),
        (WindowPolicy("random_start", size=1, start_range=(2, 4)), 4, False),
        (WindowPolicy("mix_random", size=2, start_range=(2, 3)), 4, True),
        (WindowPolicy("mix_random", size=2), 4, False),
        (WindowPolicy("mix_progressive", size=2, start_range=(2, None), iters_per_group=1), 4, True),
        (WindowPolicy("mix_progressive", size=2, iters_per_group=1), 4, False),  # reaches the end at step 2 only
    ],
)
def test_ends_at_last_step_agrees_with_the_sampled_windows(policy, num_steps, ends):
    """ends_at_last_step(policy, N) is True exactly when every sampled window, at every RL step, ends at step N - 1."""
    seeds = torch.arange(64, dtype=torch.int64)
    sampled = [sample_windows(policy, num_steps, seeds, step) for step in range(6)]
    assert all(bool((w.starts + w.size == num_steps).all()) for w in sampled) == ends
    assert ends_at_last_step(policy, num_steps) == ends
