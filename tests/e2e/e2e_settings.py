"""The tiny experiment every whole-flow test runs (overrides on the quickstart config, or sizes for any config)."""

import json
import math
import os

from safetensors.torch import load_file

from diffrl.engines.train.checkpoint import lora_file_name

# configs that exist for tests only (tiny random models: they exercise a code path, they are not demos that learn)
TEST_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


def config_file(name: str) -> str:
    """The path of tests/configs/<name>.yaml (what `diffrl train` takes as a config file)."""
    return os.path.join(TEST_CONFIGS, f"{name}.yaml")


# 2 prompts x 4 samples, 2 chunks, 2 denoising steps at 32x32: a step takes seconds on CPU. Sizes only, for any config.
TINY_SIZES = [
    "model.path=tiny:sd3",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.train=generator:ocr",
    "data.val=null",
    "rollout.max_sequence_length=null",
    "rollout.guidance_scale=4.5",
    "run.steps=3",
    "run.validate_every=0",
    "run.checkpoint_every=2",
    "run.log_images=2",
    "rollout.num_inference_steps=2",
    "rollout.height=32",
    "rollout.width=32",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=8",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=8",
    "data.num_generated=16",
    "data.num_val_prompts=2",
]
# The whole-flow tests' run: the quickstart with TINY_SIZES, trained with FlowGRPO (the rl_step flow) as the
# quickstart was before its default became DiffusionNFT on shapes-small (`algorithm=` replaces the whole section).
TINY = TINY_SIZES + [
    "algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2, noise_level: 0.7}",
    "train.lora_rank=16",
    "train.lora_alpha=32",
    "train.lr=3e-3",
]
# A shipped GPU recipe on a tiny model on the CPU: 1 step of 2 prompts x 2 samples in one chunk, a rank-4 fp32 LoRA, no
# validation; the model path, sizes and data come from each test.
TINY_RECIPE = [
    "model.dtype=fp32",
    "model.device=cpu",
    "data.val=null",
    "data.num_val_prompts=0",
    "run.steps=1",
    "run.validate_every=0",
    "run.checkpoint_every=1",
    "run.log_images=0",
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


def trained_lora(run_dir: str, step: int) -> dict:
    """The transformer LoRA saved at `step` of the run in `run_dir`, after checking that the step updated (no skipped
    step, a finite grad norm) and that the LoRA moved (a nonzero lora_B)."""
    step_dir = os.path.join(run_dir, "checkpoints", f"step_{step}")
    with open(os.path.join(step_dir, "update_metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["actor/skipped_steps"] == 0 and math.isfinite(metrics["actor/grad_norm"]), metrics
    lora = load_file(os.path.join(step_dir, "lora", lora_file_name("transformer")))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())
    return lora
