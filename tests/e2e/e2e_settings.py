"""The tiny experiment every whole-flow test runs (overrides on the quickstart config, or sizes for any config)."""

import os

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
