"""`diffrl train` of the shipped Qwen-Image-2.1 recipe on the tiny Qwen-Image-2.1 on the CPU: FlowGRPO (the recipe's
flow_grpo_fast replaced), two prompts of different lengths per step with CFG on, a rule reward; the LoRA moves."""

from __future__ import annotations

import lance
from e2e_settings import TINY_RECIPE, trained_lora

from diffrl.flows.train import train

# 2 steps, 2 prompts x 2 samples, 3 denoising steps at 32x32 (the tiny model's smallest size), CFG 2 with a negative
# prompt so cond and uncond rows of different text lengths meet in one velocity call.
TINY_21 = TINY_RECIPE + [
    "model.path=tiny:qwen_image21",
    "algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2, noise_level: 0.7}",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.num_generated=16",
    "run.steps=2",
    "run.checkpoint_every=2",
    "rollout.num_inference_steps=3",
    "rollout.height=32",
    "rollout.width=32",
    "rollout.guidance_scale=2.0",
    "rollout.negative_prompt=' '",
]


def test_flow_grpo_on_tiny_qwen_image21_trains_the_lora(workdir):
    result = train(config="qwen_image21_flow_grpo", overrides=TINY_21)
    assert result["last_step"] == 2
    trained_lora("runs/qwen-image21-ocr-lora", 2)
    rows = lance.dataset("runs/qwen-image21-ocr-lora/trajectories.lance").to_table(columns=["prompt"])
    assert len(set(rows.column("prompt").to_pylist())) == 4  # 2 steps x 2 prompts
