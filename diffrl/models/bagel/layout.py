"""The official BAGEL checkpoint folder (ByteDance-Seed/BAGEL-7B-MoT) read into diffrl's modules; safetensors only.

Files read (as the reference `app.py` / `inferencer.py` read them):
- `llm_config.json`: the Qwen2 config of the language model (Qwen2.5-7B-Instruct's shape); BAGEL's loader then sets
  qk_norm=True, tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer", as here.
- `ema.safetensors`: the whole BAGEL module (`language_model.*`, `time_embedder.*`, `vae2llm.*`, `llm2vae.*`,
  `latent_pos_embed.pos_embed`, and the understanding side `vit_model.*`, `connector.*`, `vit_pos_embed.*`). The
  max_latent_size (64 for the 7B) is read off `latent_pos_embed.pos_embed` (max_latent_size^2 rows), the VAE latent
  channels off `vae2llm.weight` (2x2 patches). lm_head and the ViT side are not loaded (text-to-image never uses
  them); any other unknown key is an error.
- `ae.safetensors`: the FLUX VAE in Black Forest Labs' layout (`encoder.down.0.block.0.conv1.weight`, ...), loaded
  into diffusers' AutoencoderKL through diffusers' own LDM converter; its shape (channels, levels, blocks, latent
  channels) is read off the weights; scale 0.3611 and shift 0.1159 are BAGEL's `load_ae` constants.
- the Qwen2 tokenizer files (`tokenizer.json` or `vocab.json` + `merges.txt`, `tokenizer_config.json`); the four
  tokens BAGEL adds when missing (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|vision_end|>`) are added the
  same way.
`vit_config.json` belongs to the layout too and is not read (no ViT for text-to-image).
"""

from __future__ import annotations

import json
import os
import re

import torch
from diffusers import AutoencoderKL
from safetensors import safe_open

from diffrl.models.bagel.mot import BagelMoT

LLM_CONFIG, EMA, AE, VIT_CONFIG = "llm_config.json", "ema.safetensors", "ae.safetensors", "vit_config.json"
# BAGEL's load_ae: the FLUX.1 autoencoder (used when a configs-only folder has no ae.safetensors to read it from)
FLUX_AE = {"ch": 128, "ch_mult": (1, 2, 4, 4), "num_res_blocks": 2, "z_channels": 16}
AE_SCALE, AE_SHIFT = 0.3611, 0.1159
LATENT_PATCH_SIZE = 2  # BagelConfig(latent_patch_size=2) in app.py
MAX_LATENT_SIZE = 64  # BagelConfig(max_latent_size=64) in app.py (read off the weights when there are weights)
# understanding-only parts, and RoPE tables a writer may have stored (diffrl recomputes them)
IGNORED_PREFIXES = (
    "language_model.lm_head.",
    "vit_model.",
    "connector.",
    "vit_pos_embed.",
    "language_model.model.rotary_emb.",
)
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


def check_folder(folder: str, *, weights: bool = True) -> None:
    """ValueError naming what is missing from a BAGEL folder (weights=False: a configs-only folder)."""
    if not os.path.isdir(folder):
        raise ValueError(f"BAGEL model path {folder!r} is not a directory")
    needed = [LLM_CONFIG] + ([EMA, AE] if weights else [])
    missing = [f for f in needed if not os.path.isfile(os.path.join(folder, f))]
    has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer.json")) or os.path.isfile(
        os.path.join(folder, "vocab.json")
    )
    if not has_tokenizer:
        missing.append("tokenizer.json (or vocab.json + merges.txt)")
    if missing:
        raise ValueError(f"{folder!r} is not a complete BAGEL folder: missing {missing} (docs/models.md, BAGEL)")
    if not weights:
        present = [f for f in (EMA, AE) if os.path.exists(os.path.join(folder, f))]
        if present:
            raise ValueError(
                f"{folder!r} holds weight files ({', '.join(present)}): a `random:` model path names a folder of "
                "configs only; load this one without the prefix"
            )


def mot_config(folder: str, *, max_latent_size: int, latent_channels: int) -> dict:
    """BagelMoT's config from llm_config.json (the Qwen2 fields the generation path uses)."""
    with open(os.path.join(folder, LLM_CONFIG)) as f:
        llm = json.load(f)
    rope = llm.get("rope_parameters") or {}
    rope_theta = llm.get("rope_theta", rope.get("rope_theta", 1000000.0))
    scaling = llm.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"{folder}/{LLM_CONFIG}: rope_scaling {scaling} is not supported (BAGEL uses plain RoPE)")
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    missing = [k for k in keys[:6] if k not in llm]
    if missing:
        raise ValueError(f"{folder}/{LLM_CONFIG} lacks {missing}")
    config = {k: llm[k] for k in keys if k in llm}
    return dict(
        config,
        rope_theta=float(rope_theta),
        latent_channels=latent_channels,
        latent_patch_size=LATENT_PATCH_SIZE,
        max_latent_size=max_latent_size,
    )


def load_mot(folder: str, *, device: torch.device, dtype: torch.dtype) -> BagelMoT:
    """BagelMoT with ema.safetensors' weights: built on the meta device, the needed tensors read one by one onto
    `device` in `dtype` (lm_head and the ViT side are never read)."""
    path = os.path.join(folder, EMA)
    with safe_open(path, framework="pt", device="cpu") as f:
        keys = list(f.keys())
        has = set(keys)
        pos_key = "latent_pos_embed.pos_embed"
        pos_rows = f.get_slice(pos_key).get_shape()[0] if pos_key in has else 0
        patch_dim = f.get_slice("vae2llm.weight").get_shape()[1] if "vae2llm.weight" in has else 0
        side = int(round(pos_rows**0.5))
        if side * side != pos_rows or patch_dim % LATENT_PATCH_SIZE**2:
            raise ValueError(f"{path}: latent_pos_embed.pos_embed / vae2llm.weight missing or not BAGEL-shaped")
        config = mot_config(folder, max_latent_size=side, latent_channels=patch_dim // LATENT_PATCH_SIZE**2)
        with torch.device("meta"):
            model = BagelMoT(**config)
        wanted = set(model.state_dict())
        unknown = [k for k in keys if k not in wanted and not k.startswith(IGNORED_PREFIXES)]
        missing = sorted(wanted - set(keys))
        if missing or unknown:
            raise ValueError(
                f"{path} does not match llm_config.json's BAGEL MoT: missing {missing[:5]} ({len(missing)}), "
                f"unexpected {unknown[:5]} ({len(unknown)})"
            )
        state = {k: f.get_tensor(k).to(device=device, dtype=dtype) for k in sorted(wanted)}
    model.load_state_dict(state, strict=True, assign=True)
    return _with_rotary(model, device)


def random_mot(folder: str, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> BagelMoT:
    """BagelMoT from llm_config.json with random weights (the module's own init), built on `device` in `dtype`:
    `model.path: random:<folder>` at real size without 29 GB of weights on disk."""
    from diffrl.models.random_weights import default_dtype, seeded

    config = mot_config(folder, max_latent_size=MAX_LATENT_SIZE, latent_channels=FLUX_AE["z_channels"])
    with seeded(seed, device), default_dtype(dtype), torch.device(device):
        model = BagelMoT(**config)
    # the fp32 position table follows `dtype` (nn.Module.to: diffusers' own .to warns on every dtype cast)
    return torch.nn.Module.to(model, dtype).eval()


def _with_rotary(model: BagelMoT, device: torch.device) -> BagelMoT:
    """Rebuild the RoPE table (a non-persistent buffer: still on the meta device after an assign-load)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    backbone = model.language_model.model
    backbone.rotary_emb = Qwen2RotaryEmbedding(config=backbone.rotary_emb.config).to(device)
    return model.eval()


# ---- the VAE ------------------------------------------------------------------------------------------------------
def ae_params(state: dict[str, torch.Tensor]) -> dict:
    """The FLUX autoencoder's shape read off BFL-layout weights: base channels, channel multipliers, res blocks per
    level, latent channels."""
    try:
        ch = state["encoder.conv_in.weight"].shape[0]
        levels = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
        blocks = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k)))
        mult = tuple(state[f"encoder.down.{i}.block.0.conv2.weight"].shape[0] // ch for i in range(levels))
        z = state["decoder.conv_in.weight"].shape[1]
    except (KeyError, ValueError) as err:
        raise ValueError(f"{AE} is not a FLUX autoencoder in Black Forest Labs' layout ({err})") from err
    return {"ch": ch, "ch_mult": mult, "num_res_blocks": blocks, "z_channels": z}


def vae_from_params(params: dict) -> AutoencoderKL:
    """diffusers' AutoencoderKL configured as the FLUX VAE of these params (FLUX.1's diffusers vae config)."""
    levels = len(params["ch_mult"])
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(params["ch"] * m for m in params["ch_mult"]),
        layers_per_block=params["num_res_blocks"],
        latent_channels=params["z_channels"],
        norm_num_groups=32,
        scaling_factor=AE_SCALE,
        shift_factor=AE_SHIFT,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def load_vae(folder: str, *, device: torch.device, dtype: torch.dtype) -> AutoencoderKL:
    """ae.safetensors (BFL layout) in diffusers' AutoencoderKL, converted by diffusers' convert_ldm_vae_checkpoint."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    state = load_file(os.path.join(folder, AE))
    vae = vae_from_params(ae_params(state))
    converted = convert_ldm_vae_checkpoint(state, vae.config)
    vae.load_state_dict(converted, strict=True)
    return _placed(vae, device, dtype)


def random_vae(*, device: torch.device, dtype: torch.dtype, seed: int = 0) -> AutoencoderKL:
    """The FLUX VAE of BAGEL's load_ae with random weights (a configs-only folder)."""
    from diffrl.models.random_weights import seeded

    with seeded(seed + 1, device):
        vae = vae_from_params(FLUX_AE)
    return _placed(vae, device, dtype)


def _placed(vae: AutoencoderKL, device: torch.device, dtype: torch.dtype) -> AutoencoderKL:
    # nn.Module.to: diffusers' own .to warns on every dtype cast (the FLUX VAE keeps no module in fp32)
    return torch.nn.Module.to(vae, device=device, dtype=dtype).eval()


def diffusers_vae_to_bfl(state: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """The inverse of diffusers' convert_ldm_vae_checkpoint for the FLUX VAE: diffusers names -> BFL's `ae.safetensors`
    names (attention projections back to 1x1 convolutions); the tiny builder writes the official layout with it."""
    out = {}
    for key, value in state.items():
        new = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", new)
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", new)
        new = re.sub(
            r"decoder\.up_blocks\.(\d+)\.", lambda m: f"decoder.up_blocks.{levels - 1 - int(m.group(1))}.", new
        )
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets\.", r"decoder.up.\1.block.", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", r"decoder.up.\1.upsample.", new)
        new = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", new)
        if "mid_block.attentions.0." in new:
            new = new.replace("mid_block.attentions.0.", "mid.attn_1.").replace("group_norm", "norm")
            new = new.replace("to_q", "q").replace("to_k", "k").replace("to_v", "v").replace("to_out.0", "proj_out")
            if value.dim() == 2:
                value = value[:, :, None, None]
        out[new] = value
    return out


# ---- the tokenizer ------------------------------------------------------------------------------------------------
def load_tokenizer(folder: str):
    """The folder's Qwen2 tokenizer with BAGEL's four special tokens (added when missing, as `add_special_tokens` in
    the reference data/data_utils.py does); returns (tokenizer, {bos, eos, start_of_image, end_of_image} ids)."""
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(folder)
    present = set(tokenizer.all_special_tokens)
    missing = [t for t in SPECIAL_TOKENS if t not in present]
    if missing:
        tokenizer.add_tokens(missing)
    bos, eos, soi, eoi = (tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    return tokenizer, {"bos_token_id": bos, "eos_token_id": eos, "start_of_image": soi, "end_of_image": eoi}
