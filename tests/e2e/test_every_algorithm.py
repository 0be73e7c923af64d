"""Every catalog algorithm trains through `diffrl train` on the tiny model as its bundle ships: `algorithm=NAME` on the
default config (TINY_SIZES), one step, so that the catalog and the flow cannot disagree (a bundle whose window
building the run rejects fails here)."""

from __future__ import annotations

import json
import math

import pytest
from e2e_settings import TINY_SIZES

from diffrl.algorithms.catalog import algorithms
from diffrl.flows.train import train

# 5 denoising steps: the largest shipped window (flow_grpo_fast: 2 steps starting in [0, 4)) fits; 2 prompts x 2.
ONE_STEP = TINY_SIZES + [
    "run.steps=1",
    "run.log_images=0",
    "data.num_val_prompts=0",
    "rollout.num_inference_steps=5",
    "rollout.group_size=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
]


# SFT trains on a dataset, not on rollouts of the default config: tests/e2e/test_sft_train.py runs it
@pytest.mark.parametrize(
    "name", sorted(n for n, a in algorithms().items() if a.needs.data != "tokens" and not a.needs.supervised)
)
def test_every_catalog_algorithm_trains_one_step_through_the_flow(workdir, name):
    result = train(config=None, overrides=ONE_STEP + [f"algorithm={name}"])
    assert result["last_step"] == 1
    with open("runs/quickstart/checkpoints/step_1/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics


def test_flow_grpo_with_an_ema_reference_and_a_velocity_kl_trains_one_step(workdir):
    """The reference is an EMA of the policy in the "old" adapter, the KL is in velocity space: both survive the
    config loader and the flow, and the first update's KL is 0 (the reference starts as the policy)."""
    overrides = ["algorithm=flow_grpo", "algorithm.reference=ema", "algorithm.reference_decay=0.9"]
    result = train(config=None, overrides=ONE_STEP + overrides + ["algorithm.kl_space=velocity"])
    assert result["last_step"] == 1
    with open("runs/quickstart/checkpoints/step_1/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    assert metrics["actor/kl_loss"] == 0.0
