"""`diffrl train` runs the shipped HunyuanImage-3.0 FlowGRPO recipe on the tiny folder on the CPU: 2 steps, the LoRA
on the MoE transformer's attention and expert projections moves, nothing else is trained."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from diffrl.flows.train import train

# The shipped config at tiny size: 2 steps, 2 prompts x 2 samples, 4 denoising steps, 64x64 (the tiny model's 1:1
# bucket), the KL term on (as in the recipe: the reference is the adapter disabled), gradient checkpointing on.
TINY_HUNYUAN = [
    "model.path=tiny:hunyuan_image3",
    "model.dtype=fp32",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=8",
    "data.num_val_prompts=0",
    "run.steps=2",
    "run.validate_every=0",
    "run.checkpoint_every=2",
    "run.log_images=0",
    "rollout.num_inference_steps=4",
    "rollout.height=64",
    "rollout.width=64",
    "rollout.max_sequence_length=64",
    "rollout.group_size=2",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "train.lora_rank=4",
    "train.lora_alpha=8",
    "train.lr=1.0e-3",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=2",
]


@pytest.mark.slow  # tens of seconds on the 2-core CPU (the Prefect flow, two RL steps with checkpoints)
def test_flow_grpo_trains_the_moe_lora(workdir):
    result = train(config="hunyuan_image3_flow_grpo", overrides=TINY_HUNYUAN)
    assert result["last_step"] == 2
    step_dir = "runs/hunyuan-image3-flow-grpo/checkpoints/step_2"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/pytorch_lora_weights.safetensors")
    assert lora and all("lora_" in k for k in lora)
    assert any("qkv_proj" in k for k in lora) and any("experts" in k for k in lora)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
