"""Tiny offline HunyuanImage-3.0 folder in the official checkpoint layout (random weights, in-memory tokenizer).

Files as in tencent/HunyuanImage-3.0 (diffrl/models/hunyuan_image3/layout.py reads them): `config.json` (the
release's keys at tiny size: 2 layers, hidden 64, 4 query / 2 key-value heads of 16, 4 routed experts of width 32
with top-2 routing and one shared expert, the MoE fields as per-layer lists as in the release, image_base_size 64;
a 5-level VAE with 16x spatial / 4x temporal factors and 4 latent channels), `generation_config.json` (the
release's sampler settings), `model.safetensors.index.json` with two shards (the backbone in one, the image head
and the VAE in the other, plus an `lm_head`, `model.ln_f` and a VAE encoder tensor as the real shards have and the
loader skips) and `tokenizer.json` (a byte-level BPE trained in memory, with HunyuanImage-3.0's added tokens). About
5.6 MB (the VAE decoder's 3D convolutions are most of it). Norm gains start near 1, and the ResBlocks' zero-
initialised output convs of the reference are random here, so the velocity depends on every part.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from diffrl.models.hunyuan_image3 import layout
from diffrl.models.hunyuan_image3.config import HunyuanImage3Config
from diffrl.models.hunyuan_image3.model import HunyuanImage3Transformer
from diffrl.models.hunyuan_image3.vae import HunyuanImage3VAE
from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

BASE_SIZE = 64  # image_base_size: 64x64 images, 4x4 latent tokens
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TINY_VAE = {
    "block_out_channels": [32, 32, 32, 32, 32],
    "downsample_match_channel": True,
    "ffactor_spatial": 16,
    "ffactor_temporal": 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 0,
    "out_channels": 3,
    "sample_size": 64,
    "sample_tsize": 16,
    "scaling_factor": 0.562679178327931,  # the release's
    "shift_factor": None,
    "upsample_match_channel": True,
}


def added_tokens(base_size: int) -> list[str]:
    """The added tokens the text-to-image path reads, in id order (<img_ratio_i> consecutive)."""
    ratios = [f"<img_ratio_{i}>" for i in range(len(layout.resolution_group(base_size)))]
    return ["<|startoftext|>", "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", f"<img_size_{base_size}>", *ratios]


def tiny_config(tokenizer, layers: int = 2) -> dict:
    """config.json of the tiny model: the release's keys at tiny size."""
    return {
        "architectures": ["HunyuanImage3ForCausalMM"],
        "model_type": "hunyuan_image_3_moe",
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 32,
        "moe_intermediate_size": [32] * layers,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_head_dim": 16,
        "num_experts": 4,
        "moe_topk": [2] * layers,
        "num_shared_expert": [1] * layers,
        "use_mixed_mlp_moe": True,
        "moe_drop_tokens": False,
        "norm_topk_prob": True,
        "use_qk_norm": True,
        "use_rotary_pos_emb": True,
        "rope_scaling": {"type": "custom", "factor": 1.0},
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "img_proj_type": "unet",
        "patch_size": 1,
        "patch_embed_hidden_dim": 32,
        "vae_downsample_factor": [16, 16],
        "image_base_size": BASE_SIZE,
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|startoftext|>"),
        "eos_token_id": 0,
        "pad_token_id": 0,
        "vae": dict(TINY_VAE),
        "torch_dtype": "float32",
    }


@register_tiny("hunyuan_image3")
def build_hunyuan_image3(out_dir: str, seed: int) -> None:
    """Write the tiny HunyuanImage-3.0 folder into out_dir."""
    tokenizer = qwen_tokenizer()
    tokenizer.add_tokens(added_tokens(BASE_SIZE), special_tokens=True)
    raw = tiny_config(tokenizer)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        backbone, rest = _tiny_weights(HunyuanImage3Config.from_dict(raw))
    os.makedirs(out_dir, exist_ok=True)
    index = {}
    for name, part in zip(SHARDS, (backbone, rest)):
        save_file(part, os.path.join(out_dir, name), metadata={"format": "pt"})
        index.update(dict.fromkeys(part, name))
    with open(os.path.join(out_dir, layout.INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(index.items()))}, f, indent=2)
    with open(os.path.join(out_dir, layout.CONFIG), "w") as f:
        json.dump(raw, f, indent=2)
    generation = dict(layout.GENERATION_DEFAULTS, sequence_template="pretrain", bot_task="image")
    with open(os.path.join(out_dir, layout.GENERATION_CONFIG), "w") as f:
        json.dump(dict(generation, use_system_prompt="None"), f, indent=2)
    tokenizer.backend_tokenizer.save(os.path.join(out_dir, layout.TOKENIZER))


def _tiny_weights(config: HunyuanImage3Config) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    transformer = HunyuanImage3Transformer(layout.config_dict(config))
    vae = HunyuanImage3VAE(config.vae)
    state = dict(transformer.state_dict())
    state.update({f"vae.{k}": v for k, v in vae.state_dict().items()})
    with torch.no_grad():
        for name, value in state.items():
            if "norm" in name and name.endswith("weight") or "layernorm" in name:  # RMS / group norm gains near 1
                value.copy_(1 + 0.1 * torch.randn_like(value))
            elif name.endswith("bias"):
                value.copy_(0.05 * torch.randn_like(value))
    hidden = config.hidden_size
    state["lm_head.weight"] = 0.02 * torch.randn(config.vocab_size, hidden)
    state["model.ln_f.weight"] = torch.ones(hidden)
    state["vae.encoder.conv_in.weight"] = 0.02 * torch.randn(32, 3, 3, 3, 3)
    state = {k: v.contiguous() for k, v in state.items()}
    backbone = {k: v for k, v in state.items() if k.startswith("model.")}
    return backbone, {k: v for k, v in state.items() if k not in backbone}
