"""The official HunyuanImage-3.0 checkpoint folder (huggingface.co/tencent/HunyuanImage-3.0) read into diffrl's
modules; safetensors only.

Files read (as the reference's `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` and
`model.load_tokenizer(folder)` read them):
- `config.json`: `HunyuanImage3Config` (architectures ["HunyuanImage3ForCausalMM"]): the MoE transformer's shape,
  the image head (`patch_embed_hidden_dim`, `patch_size`, `vae_downsample_factor`, `image_base_size`) and the VAE's
  config under `vae` (config.py).
- `generation_config.json` (optional): `diff_infer_steps`, `diff_guidance_scale`, `flow_shift` (the sampler's
  defaults; 50, 5.0 and 3.0 in the release), `sequence_template` (only "pretrain" is supported) and `bot_task`.
- the weights: `model.safetensors.index.json` and the shards it names (or, without an index, every `*.safetensors`
  file of the folder). Read: `model.wte`, `model.layers.*`, `timestep_emb`, `time_embed`, `time_embed_2`,
  `patch_embed`, `final_layer` (the transformer) and `vae.decoder.*`. Not read (text-to-image never uses them):
  `lm_head`, `model.ln_f`, `vae.encoder.*`, `vision_model.*`, `vision_aligner.*`. Any other key, or a missing one,
  is an error.
- the tokenizer: `tokenizer.json` (a fast tokenizer; loaded as transformers' PreTrainedTokenizerFast), with the
  added tokens `<boi>`, `<eoi>`, `<img>`, `<cfg>`, `<timestep>`, `<img_size_{image_base_size}>` and
  `<img_ratio_0>`.. `<img_ratio_{n-1}>`; `<bos>` is config.json's `bos_token_id`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from diffrl.models.hunyuan_image3.config import HunyuanImage3Config
from diffrl.models.hunyuan_image3.model import HunyuanImage3Transformer
from diffrl.models.hunyuan_image3.vae import HunyuanImage3VAE

CONFIG, GENERATION_CONFIG, INDEX, TOKENIZER = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
)
IGNORED_PREFIXES = ("lm_head.", "model.ln_f.", "vae.encoder.", "vision_model.", "vision_aligner.")
TOKENS = ("<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>")
# generation_config.json of tencent/HunyuanImage-3.0 (the base model's sampler defaults)
GENERATION_DEFAULTS = {"diff_infer_steps": 50, "diff_guidance_scale": 5.0, "flow_shift": 3.0}


def read_config(folder: str) -> HunyuanImage3Config:
    with open(os.path.join(folder, CONFIG)) as f:
        return HunyuanImage3Config.from_dict(json.load(f), source=os.path.join(folder, CONFIG))


def read_generation_config(folder: str) -> dict:
    """The sampler's defaults: the folder's generation_config.json over the release's values."""
    path = os.path.join(folder, GENERATION_CONFIG)
    raw = {}
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
    template = raw.get("sequence_template", "pretrain")
    if template != "pretrain":
        raise ValueError(f"{path}: sequence_template={template!r}; only the base model's 'pretrain' is supported")
    return {k: raw.get(k, v) for k, v in GENERATION_DEFAULTS.items()}


def weight_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing or not names:
        raise ValueError(f"{folder!r}: safetensors shards missing: {missing or 'none found'} (docs/models.md)")
    return [os.path.join(folder, n) for n in names]


def check_folder(folder: str, *, weights: bool = True) -> None:
    """ValueError naming what is missing from a HunyuanImage-3.0 folder (weights=False: a configs-only folder)."""
    if not os.path.isdir(folder):
        raise ValueError(f"HunyuanImage-3.0 model path {folder!r} is not a directory")
    missing = [f for f in (CONFIG, TOKENIZER) if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(f"{folder!r} is not a complete HunyuanImage-3.0 folder: missing {missing} (docs/models.md)")
    shards = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    if weights:
        weight_files(folder)
    elif shards:
        raise ValueError(
            f"{folder!r} holds weight files ({', '.join(sorted(shards)[:3])}): a `random:` model path names a folder "
            "of configs only; load this one without the prefix"
        )


def load_weights(folder: str, config: HunyuanImage3Config, *, device, dtype):
    """(transformer, vae) built on the meta device and filled from the shards, tensor by tensor."""
    with torch.device("meta"):
        transformer = HunyuanImage3Transformer(config_dict(config))
        vae = HunyuanImage3VAE(config.vae)
    wanted = {k: ("t", k) for k in transformer.state_dict()}
    wanted.update({f"vae.{k}": ("v", k) for k in vae.state_dict()})
    states: dict[str, dict] = {"t": {}, "v": {}}
    unknown = []
    for path in weight_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in wanted:
                    part, name = wanted[key]
                    states[part][name] = f.get_tensor(key).to(device=device, dtype=dtype)
                elif not key.startswith(IGNORED_PREFIXES):
                    unknown.append(key)
    missing = sorted(k for k, (part, name) in wanted.items() if name not in states[part])
    if missing or unknown:
        raise ValueError(
            f"{folder!r}: the shards do not match config.json's HunyuanImage-3.0: missing {missing[:5]} "
            f"({len(missing)}), unexpected {sorted(unknown)[:5]} ({len(unknown)})"
        )
    transformer.load_state_dict(states["t"], strict=True, assign=True)
    vae.load_state_dict(states["v"], strict=True, assign=True)
    return transformer.eval(), vae.eval()


def random_weights(config: HunyuanImage3Config, *, device, dtype, seed: int = 0):
    """(transformer, vae) with the modules' own random init, built on `device` in `dtype` (a configs-only folder)."""
    from diffrl.models.random_weights import default_dtype, seeded

    with seeded(seed, device), default_dtype(dtype), torch.device(device):
        transformer = HunyuanImage3Transformer(config_dict(config))
        vae = HunyuanImage3VAE(config.vae)
    return transformer.eval(), vae.eval()


def config_dict(config: HunyuanImage3Config) -> dict:
    """The config as the JSON-able dict HunyuanImage3Transformer takes."""
    import dataclasses

    raw = dataclasses.asdict(config)
    raw.pop("extra")
    raw["vae_downsample_factor"] = list(raw["vae_downsample_factor"])
    return raw


# ---- the tokenizer and the resolution buckets ---------------------------------------------------------------------
def resolution_group(base_size: int) -> list[tuple[int, int]]:
    """(height, width) buckets sorted by height / width, as the reference's `ResolutionGroup(base_size)`: from
    base x base, step base // 16, towards (2 base, base / 2) and (base / 2, 2 base) (33 buckets for 1024)."""
    step, low, high = base_size // 16, base_size // 2, base_size * 2
    buckets = [(base_size, base_size)]
    h = w = base_size
    while not (h >= high and w <= low):
        h, w = min(h + step, high), max(w - step, low)
        buckets.append((h, w))
    h = w = base_size
    while not (h <= low and w >= high):
        h, w = max(h - step, low), min(w + step, high)
        buckets.append((h, w))
    return sorted(buckets, key=lambda hw: hw[0] / hw[1])


def load_tokenizer(folder: str, config: HunyuanImage3Config):
    """(tokenizer, ids): the folder's tokenizer.json and the ids of bos, the image markers and the size/ratio
    tokens (`ratio_offset` = id of <img_ratio_0>; ratio i is ratio_offset + i, as the reference assumes)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, TOKENIZER))
    vocab = tokenizer.get_vocab()
    size = f"<img_size_{config.image_base_size}>"
    count = len(resolution_group(config.image_base_size))
    needed = [*TOKENS, size, "<img_ratio_0>", f"<img_ratio_{count - 1}>"]
    missing = [t for t in needed if t not in vocab]
    if missing:
        raise ValueError(f"{folder}/{TOKENIZER} lacks HunyuanImage-3.0's tokens {missing}")
    ids = {t.strip("<>"): vocab[t] for t in TOKENS}
    ids.update(bos=config.bos_token_id, size=vocab[size], ratio_offset=vocab["<img_ratio_0>"])
    if vocab[f"<img_ratio_{count - 1}>"] != ids["ratio_offset"] + count - 1:
        raise ValueError(f"{folder}/{TOKENIZER}: <img_ratio_i> ids are not consecutive")
    too_big = [k for k, v in ids.items() if v >= config.vocab_size]
    if too_big:
        raise ValueError(f"{folder}: token ids {too_big} lie past config.json's vocab_size={config.vocab_size}")
    return tokenizer, ids
