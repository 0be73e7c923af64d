"""`diffrl train` of the shipped FLUX.2-klein recipe on the tiny FLUX.2-klein on the CPU: FlowGRPO with its one-step
SDE window and CFG against the empty prompt; the step trains and the LoRA moves."""

from __future__ import annotations

import json
import math

import lance
from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

# 1 step, 2 prompts x 2 samples, 4 denoising steps at 32x32 (the recipe's window: one SDE step in steps 1-3), CFG 4,
# the JPEG-size reward (fast; the recipe's OCR reward would read random images).
TINY_FLUX2 = [
    "model.path=tiny:flux2",
    "model.dtype=fp32",
    "model.device=cpu",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=8",
    "data.num_val_prompts=0",
    "run.steps=1",
    "run.validate_every=0",
    "run.checkpoint_every=1",
    "run.log_images=0",
    "rollout.num_inference_steps=4",
    "rollout.height=32",
    "rollout.width=32",
    "rollout.group_size=2",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=1e-3",
    "train.lora_compute=fp32",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=4",
]


def test_flow_grpo_on_tiny_flux2_klein_trains_the_lora(workdir):
    result = train(config="flux2_klein_flow_grpo", overrides=TINY_FLUX2)
    assert result["last_step"] == 1
    step_dir = "runs/flux2-klein-flow-grpo/checkpoints/step_1"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/{lora_file_name('transformer')}")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    assert any("single_transformer_blocks" in k for k in lora)  # the single-stream blocks are trained too
    rows = lance.dataset("runs/flux2-klein-flow-grpo/trajectories.lance").to_table(columns=["window_start"])
    starts = rows.column("window_start").to_pylist()
    assert len(starts) == 4 and all(1 <= s <= 3 for s in starts)  # the recipe's window
