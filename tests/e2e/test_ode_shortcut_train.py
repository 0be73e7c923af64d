"""`diffrl train` with the rollout's ODE tail shortcut on (rollout.ode_tail): two FlowGRPO-Fast steps on the
tiny model, windows of 2 steps starting in [0, 4) of 8, the tail after each chunk's last window on 2 evaluations."""

from __future__ import annotations

import json
import math

import pytest
from e2e_settings import TINY_SIZES

from diffrl.flows.train import train


@pytest.mark.slow  # measured 34 s on the 2-core CPU
def test_two_steps_train_with_the_ode_tail_on(workdir):
    overrides = TINY_SIZES + [
        "algorithm=flow_grpo_fast",
        "run.steps=2",
        "run.log_images=0",
        "run.checkpoint_every=2",
        "rollout.num_inference_steps=8",
        "rollout.ode_tail={solver: dpm2m, evaluations: 2}",
    ]
    result = train(config=None, overrides=overrides)
    assert result["last_step"] == 2
    with open("runs/quickstart/checkpoints/step_2/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
