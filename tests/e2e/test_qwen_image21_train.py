"""`diffrl train` of the shipped Qwen-Image-2.1 recipe on the tiny Qwen-Image-2.1 on the CPU: FlowGRPO (the recipe's
flow_grpo_fast replaced), two prompts of different lengths per step with CFG on, a rule reward; the LoRA moves."""

from __future__ import annotations

import json
import math

import lance
from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name
from diffrl.flows.train import train

# 2 steps, 2 prompts x 2 samples, 3 denoising steps at 32x32 (the tiny model's smallest size), CFG 2 with a negative
# prompt so cond and uncond rows of different text lengths meet in one velocity call.
TINY_21 = [
    "model.path=tiny:qwen_image21",
    "model.dtype=fp32",
    "model.device=cpu",
    "algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2, noise_level: 0.7}",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=16",
    "data.num_val_prompts=0",
    "run.steps=2",
    "run.validate_every=0",
    "run.checkpoint_every=2",
    "run.log_images=0",
    "rollout.num_inference_steps=3",
    "rollout.height=32",
    "rollout.width=32",
    "rollout.guidance_scale=2.0",
    "rollout.negative_prompt=' '",
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


def test_flow_grpo_on_tiny_qwen_image21_trains_the_lora(workdir):
    result = train(config="qwen_image21_flow_grpo", overrides=TINY_21)
    assert result["last_step"] == 2
    step_dir = "runs/qwen-image21-ocr-lora/checkpoints/step_2"
    with open(f"{step_dir}/update_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(f"{step_dir}/lora/{lora_file_name('transformer')}")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    rows = lance.dataset("runs/qwen-image21-ocr-lora/trajectories.lance").to_table(columns=["prompt"])
    assert len(set(rows.column("prompt").to_pylist())) == 4  # 2 steps x 2 prompts
