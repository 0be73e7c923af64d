"""Offline tiny models: every supported architecture at tiny size with random weights, saved as an
ordinary diffusers folder that `DiffusionPipeline.from_pretrained` loads with no network.

One builder per architecture (diffrl/models/tiny/<arch>.py), registered with `register_tiny`; tokenizers are
built in memory (diffrl/models/tiny/tokenizers.py) so nothing is downloaded. Deterministic for a seed.
"""

from __future__ import annotations

import os
from typing import Callable

from diffrl import registry

registry.declare(
    "tiny",
    (
        "diffrl.models.tiny.bagel",
        "diffrl.models.tiny.flux",
        "diffrl.models.tiny.hunyuan_image3",
        "diffrl.models.tiny.janus",
        "diffrl.models.tiny.llava",
        "diffrl.models.tiny.qwen",
        "diffrl.models.tiny.qwen_edit",
        "diffrl.models.tiny.qwen3_lm",
        "diffrl.models.tiny.qwen3_omni",
        "diffrl.models.tiny.sd3",
        "diffrl.models.tiny.wan",
    ),
    label="tiny architecture",
)


def register_tiny(arch: str) -> Callable:
    """Decorator: `fn(out_dir, seed)` builds and saves the tiny pipeline of `arch` into out_dir (diffrl.registry)."""
    return registry.register("tiny", arch)


def tiny_architectures() -> list[str]:
    return registry.names("tiny")


def build_tiny(arch: str, out_dir: str, *, seed: int = 0) -> str:
    """Build the tiny `arch` pipeline with random weights (seeded) and save it to out_dir."""
    build = registry.get("tiny", arch).obj
    os.makedirs(out_dir, exist_ok=True)
    build(out_dir, seed)
    return out_dir
