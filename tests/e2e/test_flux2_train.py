"""`diffrl train` of the shipped FLUX.2-klein recipe on the tiny FLUX.2-klein on the CPU: FlowGRPO with its one-step
SDE window and CFG against the empty prompt; the step trains and the LoRA moves."""

from __future__ import annotations

import lance
from e2e_settings import TINY_RECIPE, trained_lora

from diffrl.flows.train import train

# 4 denoising steps at 32x32 (the recipe's window: one SDE step in steps 1-3), CFG 4, the JPEG-size reward (fast; the
# recipe's OCR reward would read random images).
TINY_FLUX2 = TINY_RECIPE + [
    "model.path=tiny:flux2",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.num_generated=8",
    "rollout.num_inference_steps=4",
    "rollout.height=32",
    "rollout.width=32",
]


def test_flow_grpo_on_tiny_flux2_klein_trains_the_lora(workdir):
    result = train(config="flux2_klein_flow_grpo", overrides=TINY_FLUX2)
    assert result["last_step"] == 1
    lora = trained_lora("runs/flux2-klein-flow-grpo", 1)
    assert any("single_transformer_blocks" in k for k in lora)  # the single-stream blocks are trained too
    rows = lance.dataset("runs/flux2-klein-flow-grpo/trajectories.lance").to_table(columns=["window_start"])
    starts = rows.column("window_start").to_pylist()
    assert len(starts) == 4 and all(1 <= s <= 3 for s in starts)  # the recipe's window
