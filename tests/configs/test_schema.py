"""The experiment schema: every shipped config loads; algorithm bundles with overrides; cross-field checks."""

from __future__ import annotations

import os

import pytest

from configs.loader import ConfigError
from configs.schema import CONFIG_DIR, load_experiment

SHIPPED = sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads(name):
    cfg = load_experiment(name)
    assert cfg.run.name and cfg.rollout.samples_per_step >= cfg.rollout.group_size


def test_qwen_image_recipe_is_verl_omnis():
    cfg = load_experiment("qwen_image_ocr_lora")
    assert (cfg.rollout.height, cfg.rollout.num_inference_steps, cfg.rollout.guidance_scale) == (512, 10, 4.0)
    assert cfg.algorithm.noise_level == 1.2 and cfg.algorithm.clip_ratio == 1e-5
    assert (cfg.algorithm.window.kind, cfg.algorithm.window.size, cfg.algorithm.window.start_range) == \
        ("random_start", 2, (0, 5))
    assert (cfg.rollout.group_size, cfg.rollout.prompts_per_step) == (16, 32)
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lr, cfg.train.mini_batch_prompts) == (64, 128, 3e-4, 16)


def test_algorithm_bundle_with_overrides():
    cfg = load_experiment(None, ["algorithm.name=mix_grpo", "algorithm.window.size=2", "algorithm.kl_coef=0.01"])
    assert cfg.algorithm.name == "mix_grpo" and cfg.algorithm.kl_coef == 0.01
    assert cfg.algorithm.window.kind == "mix_progressive" and cfg.algorithm.window.size == 2
    # the algorithm's stochastic parts reach the sampler
    assert cfg.sampling.sde_type == cfg.algorithm.sde_type and cfg.sampling.window == cfg.algorithm.window


def test_scientific_notation_without_a_dot_is_a_number_everywhere():
    """YAML 1.1 (PyYAML) reads `1e-4` as a string; typed fields, the algorithm's included, take it as a float."""
    cfg = load_experiment(None, ["algorithm.clip_ratio=1e-4", "algorithm.kl_coef=4e-2", "train.lr=3e-4"])
    assert (cfg.algorithm.clip_ratio, cfg.algorithm.kl_coef, cfg.train.lr) == (1e-4, 0.04, 3e-4)
    assert isinstance(cfg.algorithm.clip_ratio, float)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.clip_ratio=tiny"], r"algorithm.clip_ratio: expected a number, got 'tiny'"),
    (["model.attention=sage"], r"model.attention must be one of default, cudnn, flash, efficient, math"),
    (["algorithm.name=flow_grpoo"], r"unknown algorithm 'flow_grpoo'"),
    (["algorithm.clip_ratoi=0.1"], r"unknown Algorithm field"),
    (["rollout.same_noise_per_group=true", "rollout.chunk_size=4"], r"whole groups per chunk"),
    (["train.mini_batch_prompts=64"], r"exceeds rollout.prompts_per_step"),
    (["rollout.chunk_size=3"], r"multiple or a divisor"),
    (["model.dtype=fp8"], r"model.dtype must be one of"),
    (["cluster.mode=k8s"], r"cluster.mode must be"),
    (["rollout.num_inference_steps=1"], r"algorithm.window 'all_but_last' does not fit rollout.num_inference_steps=1"),
    (["data.val_samples_per_prompt=0"], r"data.val_samples_per_prompt must be >= 1, got 0"),
])
def test_bad_values_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(None, overrides)
