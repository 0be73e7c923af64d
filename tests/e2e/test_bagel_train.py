"""`diffrl train` runs the shipped BAGEL FlowGRPO recipe on the tiny BAGEL folder on the CPU: 2 steps, the LoRA on
the generation expert moves, nothing else is trained."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from diffrl.flows.train import train

# The shipped config at tiny size: 2 steps, 2 prompts x 2 samples, 4 denoising steps with a 2-step SDE window
# starting in [0, 2), 64x64, gradient checkpointing on as in the recipe.
TINY_BAGEL = [
    "model.path=tiny:bagel",
    "model.dtype=fp32",
    "reward.components=[{name: jpeg_compressibility}]",
    "algorithm.window.start_range=[0, 2]",
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


@pytest.mark.slow  # ~50 s on the 2-core CPU (the Prefect flow, two RL steps with checkpoints)
def test_flow_grpo_trains_the_generation_expert_lora(workdir):
    result = train(config="bagel_flow_grpo", overrides=TINY_BAGEL)
    assert result["last_step"] == 2
    step_dir = "runs/bagel-flow-grpo/checkpoints/step_2"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/pytorch_lora_weights.safetensors")
    assert lora and all("_moe_gen" in k for k in lora)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
