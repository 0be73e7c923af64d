"""`diffrl train` of the shipped Wan2.2 A14B DanceGRPO recipe on the tiny two-expert Wan2.2: both experts train."""

from __future__ import annotations

import json
import math

from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

# The shipped config at tiny size on the CPU: 2 steps, 2 prompts x 2 samples, 4 denoising steps (timesteps ~1000,
# 960 on the high-noise expert, ~857 on the low-noise one, the last an ODE step), 16x16x5.
TINY_WAN22 = [
    "model.path=tiny:wan22",
    "model.dtype=fp32",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=8",
    "data.num_val_prompts=0",
    "run.steps=2",
    "run.validate_every=0",
    "run.checkpoint_every=1",
    "run.log_images=0",
    "rollout.num_inference_steps=4",
    "rollout.height=16",
    "rollout.width=16",
    "rollout.num_frames=5",
    "rollout.max_sequence_length=16",
    "rollout.group_size=2",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=1e-3",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=2",
    "train.gradient_checkpointing=false",
]


def test_dance_grpo_on_two_experts_trains_both(workdir):
    result = train(config="wan22_dance_grpo", overrides=TINY_WAN22)
    assert result["last_step"] == 2
    step_dir = "runs/wan22-dance-grpo/checkpoints/step_2"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    for component in ("transformer", "transformer_2"):  # each expert's LoRA B moved off its zero init
        lora = load_file(f"{step_dir}/lora/{lora_file_name(component)}")
        assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items()), component
