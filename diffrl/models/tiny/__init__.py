"""Offline tiny models: every supported architecture at tiny size with random weights, saved as an
ordinary diffusers folder that `DiffusionPipeline.from_pretrained` loads with no network.

One builder per architecture (diffrl/models/tiny/<arch>.py), registered with `register_tiny`; tokenizers are
built in memory (diffrl/models/tiny/tokenizers.py) so nothing is downloaded. Deterministic for a seed.
"""

from __future__ import annotations

import os
from typing import Callable

_BUILDERS: dict[str, Callable[[str, int], None]] = {}


def register_tiny(arch: str):
    """Decorator: `fn(out_dir, seed)` builds and saves the tiny pipeline of `arch` into out_dir."""

    def wrap(fn):
        _BUILDERS[arch] = fn
        return fn

    return wrap


def tiny_architectures() -> list[str]:
    _load_builders()
    return sorted(_BUILDERS)


def build_tiny(arch: str, out_dir: str, *, seed: int = 0) -> str:
    """Build the tiny `arch` pipeline with random weights (seeded) and save it to out_dir."""
    _load_builders()
    if arch not in _BUILDERS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_BUILDERS)}")
    os.makedirs(out_dir, exist_ok=True)
    _BUILDERS[arch](out_dir, seed)
    return out_dir


def _load_builders() -> None:
    # Each module registers its builder on import.
    from diffrl.models.tiny import flux, qwen, sd3, wan  # noqa: F401
