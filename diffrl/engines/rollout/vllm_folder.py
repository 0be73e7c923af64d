"""The model folder a vLLM server loads for the policy's folder: the folder itself, except for a Qwen3-Omni Thinker.

vLLM 0.24 serves the Thinker only as the Thinker of a whole Qwen3-Omni model: its registry knows the architecture
`Qwen3OmniMoeForConditionalGeneration` (the Thinker-only class name of transformers' folders is not in it), its
multimodal processor reads `hf_config.thinker_config`, and its weight loader maps the checkpoint names of the whole
model (`thinker.model.*` -> the language model, `thinker.visual.*`, `thinker.audio_tower.*`). A Thinker folder as
transformers writes it (config `model_type: qwen3_omni_moe_thinker`, names `model.*`, `lm_head.*`, `visual.*`,
`audio_tower.*`) is therefore written once more beside the run (`thinker_as_omni_folder`):

    config.json       {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
                       "thinker_config": <the Thinker's config>, "enable_audio_output": false}; the vision config
                      gains the keys vLLM's vision tower reads and transformers' Thinker config lacks: `image_size`
                      (patch_size x the side of its position-embedding grid) and `apply_vit_abs_pos_embed` (true:
                      transformers' tower adds its learned position embedding), the text config
                      `tie_word_embeddings` (the Thinker's own)
    *.safetensors     the same tensors under `thinker.<name>` (one shard at a time; none for a config-only folder
                      served with `load_format: dummy`), the index's weight map renamed alike
    the rest          tokenizer, chat template, preprocessor and generation configs, copied

Weights of a later policy version go to the server in the same names (`save_thinker`). vLLM 0.24's Thinker module
takes no LoRA adapters (it does not declare SupportsLoRA): a Thinker is served with `weight_sync: full`, trained
without LoRA.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

from safetensors.torch import load_file, save_file
from torch import nn

THINKER_TYPES = ("qwen3_omni_moe_thinker",)
THINKER_PREFIX = "thinker."  # the Thinker's tensors in a whole Qwen3-Omni checkpoint
_INDEX = "model.safetensors.index.json"


def model_type(folder: str) -> str:
    """config.json's model_type ('' when it has none)."""
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f).get("model_type", "")


def is_thinker(folder: str) -> bool:
    return model_type(folder) in THINKER_TYPES


def served_folder(source: str, out_dir: str) -> str:
    """The folder to serve for the policy folder `source`: `source`, or for a Thinker its whole-model form written to
    `out_dir` (module docstring)."""
    return thinker_as_omni_folder(source, out_dir) if is_thinker(source) else source


def omni_config(thinker: dict) -> dict:
    """A whole Qwen3-Omni config.json around a Thinker's config (the module docstring's keys)."""
    thinker = json.loads(json.dumps(thinker))  # a deep copy
    vision, text = thinker.setdefault("vision_config", {}), thinker.setdefault("text_config", {})
    if "image_size" not in vision:
        grid = math.isqrt(int(vision.get("num_position_embeddings", 2304)))
        vision["image_size"] = int(vision.get("patch_size", 16)) * grid
    vision.setdefault("apply_vit_abs_pos_embed", True)
    text.setdefault("tie_word_embeddings", bool(thinker.get("tie_word_embeddings", False)))
    return {
        "model_type": "qwen3_omni_moe",
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "thinker_config": thinker,
        "enable_audio_output": False,
    }


def thinker_as_omni_folder(source: str, out_dir: str) -> str:
    """Write the whole-model form of the Thinker folder `source` to `out_dir` (written aside, then renamed)."""
    tmp = f"{out_dir}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(source, "config.json")) as f:
        config = omni_config(json.load(f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if name == "config.json" or not os.path.isfile(path):
            continue
        if name.endswith(".safetensors"):
            state = load_file(path)
            save_file(
                {THINKER_PREFIX + k: v for k, v in state.items()}, os.path.join(tmp, name), metadata={"format": "pt"}
            )
            del state
        elif name == _INDEX:
            with open(path) as f:
                index = json.load(f)
            index["weight_map"] = {THINKER_PREFIX + k: v for k, v in index.get("weight_map", {}).items()}
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(index, f, indent=2)
        else:
            shutil.copy(path, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return out_dir


def save_thinker(model: nn.Module, folder: str) -> str:
    """The Thinker's current weights as a whole-model folder (full fine-tuning). transformers holds the Thinker under
    other names than its checkpoints (`model.language_model.*`, experts fused into one tensor per layer) and writes
    the checkpoint's with save_pretrained; those are then prefixed `thinker.` (`thinker_as_omni_folder`)."""
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError("a Thinker served by vLLM takes full weights only: train it without LoRA (train.lora=false)")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(folder))) as saved:
        model.save_pretrained(saved, safe_serialization=True)
        return thinker_as_omni_folder(saved, folder)
