"""Every catalog algorithm trains through `diffrl train` on the tiny model as its bundle ships: `algorithm=NAME` on the
default config (TINY_SIZES), one step, so that the catalog and the flow cannot disagree (a bundle whose window
building the run rejects fails here). An algorithm that distils a teacher (diffusion_opd) gets one that differs from
the policy (the tiny SD3 built from another seed) and trains three steps, over which the distillation loss it logs
must fall."""

from __future__ import annotations

import json
import math
import os

import pytest
from e2e_settings import TINY_SIZES
from mlflow.tracking import MlflowClient

from diffrl.algorithms.catalog import algorithms
from diffrl.flows.build import cache_dir
from diffrl.flows.train import train
from diffrl.models.tiny import cached_tiny

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
    distils = algorithms()[name].needs.teacher
    steps = 3 if distils else 1
    teacher = [f"model.teacher={cached_tiny('sd3', os.path.join(cache_dir(), 'tiny'), seed=1)}", "train.lr=1.0e-2"]
    result = train(config=None, overrides=ONE_STEP + [f"run.steps={steps}", f"algorithm={name}"] + teacher * distils)
    assert result["last_step"] == steps
    with open(f"runs/quickstart/checkpoints/step_{steps}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    if distils:
        client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        history = sorted(client.get_metric_history(run.info.run_id, "actor/distill_kl_loss"), key=lambda m: m.step)
        kl = [m.value for m in history]
        assert len(kl) == 3 and kl[2] < kl[1] < kl[0], kl


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
