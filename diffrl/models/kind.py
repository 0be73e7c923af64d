"""Which family a model path belongs to, read without loading it: "diffusion" (a diffusers pipeline folder with
model_index.json; the adapters of diffrl/models/base.py) or "autoregressive" (a Hugging Face model folder with
config.json; diffrl/models/causal_lm/policy.py, and Janus-Pro's image-token generation, diffrl/models/janus/policy.py).
The step core builds its engines by this kind, and a config whose algorithm trains the other family is refused before
anything loads.
"""

from __future__ import annotations

import json
import os

KINDS = ("diffusion", "autoregressive")
# `tiny:<arch>` builders (diffrl/models/<arch folder>/tiny*.py) that write a causal LM folder
AUTOREGRESSIVE_TINY = ("qwen3_omni", "qwen3", "janus")
RANDOM = "random:"  # model.path prefix: a folder of configs only, built with random weights in memory
REFERENCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference")


def is_bagel_folder(folder: str) -> bool:
    """A BAGEL checkpoint folder (ByteDance-Seed/BAGEL-7B-MoT's layout, or its configs only): llm_config.json is its
    own file (diffrl/models/bagel/layout.py). It may also hold a config.json, so it is checked first."""
    return os.path.isfile(os.path.join(folder, "llm_config.json"))


def is_hunyuan_image3_folder(folder: str) -> bool:
    """A HunyuanImage-3.0 folder (tencent/HunyuanImage-3.0's layout, or its configs only): a config.json naming
    HunyuanImage3ForCausalMM or model_type hunyuan_image_3_moe (diffrl/models/hunyuan_image3/layout.py). Its
    config.json would otherwise read as a causal LM's, so it is checked first."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        raw = json.load(f)
    return (
        "HunyuanImage3ForCausalMM" in (raw.get("architectures") or []) or raw.get("model_type") == "hunyuan_image_3_moe"
    )


def folder_kind(folder: str) -> str | None:
    """The kind of a local model folder, or None when it is neither (or does not exist)."""
    if os.path.isfile(os.path.join(folder, "model_index.json")) or is_bagel_folder(folder):
        return "diffusion"
    if is_hunyuan_image3_folder(folder):
        return "diffusion"
    if os.path.isfile(os.path.join(folder, "config.json")):
        return "autoregressive"
    return None


def model_kind(path: str) -> str | None:
    """The kind of `model.path` as a config names it (`tiny:<arch>`, `reference:<name>`, `random:<folder>`, a local
    folder); None for
    what cannot be told without loading it (a Hub id, a folder not there yet)."""
    if path.startswith("tiny:"):
        return "autoregressive" if path.split(":", 1)[1] in AUTOREGRESSIVE_TINY else "diffusion"
    if path.startswith(RANDOM):  # a config-only causal LM folder, random weights (diffrl/models/causal_lm/realsize.py)
        return folder_kind(path.removeprefix(RANDOM))
    if path.startswith("reference:"):
        return folder_kind(os.path.join(REFERENCE_DIR, path.split(":", 1)[1]))
    return folder_kind(path) if os.path.isdir(path) else None


def data_kind(needs_data: str) -> str:
    """The model kind an algorithm trains, from its Needs.data: tokens are autoregressive, the rest diffusion."""
    return "autoregressive" if needs_data == "tokens" else "diffusion"
