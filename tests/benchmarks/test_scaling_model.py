"""benchmarks/scaling_model.py's asynchronous step against its closed form on a hand-made recipe: the rollout beside
the update makes a step max(rollout, training) + sync at full overlap and their sum + sync at none, and the flow's
tasks still set the pace where they outlast both."""

from __future__ import annotations

import pytest

from benchmarks.scaling_model import async_step_seconds, step_seconds

# 8 images a step: 1 s of rollout, 0.125 s of scoring and 0.5 s of update per image; nothing written or exchanged
RECIPE = dict(B=8, chunk=8, n_opt=1, g=1.0, u=0.5, r=0.125, L=0.0, P=0.0, lora_params=250)
LINK, COPY = 1e3, 1e3  # bytes/s: the 1000 bytes of fp32 LoRA gradients cross in 1 s, the LoRA copy takes 1 s


def _async(n: int, overlap: float, task_s: float = 0.0) -> dict:
    return async_step_seconds(RECIPE, n, LINK, task_s, 1.0, overlap=overlap, recompute=0.25, copy_bw=COPY)


def test_an_asynchronous_step_is_the_max_of_rollout_and_training_plus_the_sync_at_full_overlap():
    sync = step_seconds(RECIPE, 1, LINK, 0.0, 1.0, weak=False)
    assert sync["seconds"] == pytest.approx(8 + 1 + 4)  # generate + reward + update, in turn
    rollout, training = 8 + 1, 4 + 0.25 * 8 * 0.5  # the update pays the old-log-prob recompute
    full, none, half = _async(1, 1.0), _async(1, 0.0), _async(1, 0.5)
    assert full["recompute"] == pytest.approx(1.0) and full["sync"] == pytest.approx(1.0)
    assert full["seconds"] == pytest.approx(max(rollout, training) + 1)
    assert none["seconds"] == pytest.approx(rollout + training + 1)  # no overlap: slower than the synchronous step
    assert half["seconds"] == pytest.approx(rollout + training - 0.5 * min(rollout, training) + 1)
    assert full["images_per_s"] == pytest.approx(8 / 10)
    # two replicas: 4 images each, the update with its gradient all-reduce (2 x 1/2 x 1000 bytes / link)
    two = _async(2, 1.0)
    assert two["update"] == pytest.approx(2 + 1) and two["reward"] == pytest.approx(0.5)
    assert two["seconds"] == pytest.approx(max(4 + 0.5, 3 + 0.25 * 4 * 0.5) + 1)


def test_the_flows_tasks_set_the_pace_of_both_when_they_outlast_the_step():
    # (1 generate round + 5) tasks x 3 s = 18 s, more than either step's work: no gain from the overlap
    sync = step_seconds(RECIPE, 1, LINK, 3.0, 1.0, weak=False)
    full = _async(1, 1.0, task_s=3.0)
    assert sync["seconds"] == pytest.approx(18) and full["seconds"] == pytest.approx(18)
    assert full["orchestration"] == pytest.approx(18 - 10)
