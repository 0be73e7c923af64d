"""GARDO's KL gate through `diffrl train`: the update stage ranks the main reward component against the others and
only the most uncertain samples pay the KL (Needs.reward_gate)."""

from __future__ import annotations

import json

import pytest
from test_every_algorithm import ONE_STEP


def test_gardo_gates_the_kl_by_the_reward_components(workdir):
    from diffrl.flows.train import train

    components = "reward.components=[{name: jpeg_compressibility}, {name: jpeg_incompressibility, weight: 0.1}]"
    gate = "algorithm={name: gardo, kl_gate_fraction: 0.5, main_reward: jpeg_compressibility}"
    result = train(config=None, overrides=ONE_STEP + [components, gate])
    assert result["last_step"] == 1
    with open("runs/quickstart/checkpoints/step_1/update_metrics.json") as f:
        metrics = json.load(f)
    # 4 samples; incompressibility ranks them in the reverse order: u = rank_main - rank_aux is -3, -1, 1, 3; the
    # 0.5 quantile of {1, 3} is 2, so one sample of four pays the KL
    assert metrics["actor/kl_gated_frac"] == pytest.approx(0.25) and metrics["actor/skipped_steps"] == 0
