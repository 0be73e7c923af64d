"""Tiny offline BAGEL folder in the official checkpoint layout (random weights, in-memory Qwen2 tokenizer).

Files as in ByteDance-Seed/BAGEL-7B-MoT (diffrl/models/bagel/layout.py reads them): `llm_config.json` (a 2-layer
Qwen2 with BAGEL's qk_norm / layer_module entries), `vit_config.json` (a tiny SigLIP config, not read),
`ema.safetensors` (the MoT with both experts, the connectors, the position table, and an lm_head as the real file
has; no ViT weights), `ae.safetensors` (a 4-level FLUX-style VAE in Black Forest Labs' key layout, 4 latent
channels) and the tokenizer files. The generation expert starts as a perturbed copy of the understanding expert
(BAGEL initialises it as a copy, `init_moe`), so the two differ and a test can tell which one ran.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from diffrl.models.bagel.layout import AE, EMA, LLM_CONFIG, VIT_CONFIG, diffusers_vae_to_bfl, vae_from_params
from diffrl.models.bagel.mot import BagelMoT
from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

TINY_AE = {"ch": 32, "ch_mult": (1, 1, 1, 1), "num_res_blocks": 1, "z_channels": 4}
MAX_LATENT_SIZE = 16  # up to 256 x 256 images


def tiny_llm_config(vocab_size: int) -> dict:
    """llm_config.json of the tiny model: the real file's keys at tiny size."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "qk_norm": True,
        "layer_module": "Qwen2MoTDecoderLayer",
        "bos_token_id": 0,
        "eos_token_id": 2,
    }


@register_tiny("bagel")
def build_bagel(out_dir: str, seed: int) -> None:
    """Write the tiny BAGEL folder (about 0.4 MB) into out_dir."""
    tokenizer = qwen_tokenizer(
        named_specials={"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
    )
    llm = tiny_llm_config(len(tokenizer))
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        ema, vae_state = _tiny_weights(llm)
    os.makedirs(out_dir, exist_ok=True)
    save_file(ema, os.path.join(out_dir, EMA))
    save_file(vae_state, os.path.join(out_dir, AE))
    with open(os.path.join(out_dir, LLM_CONFIG), "w") as f:
        json.dump(llm, f, indent=2)
    vit = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2}
    with open(os.path.join(out_dir, VIT_CONFIG), "w") as f:
        json.dump(dict(vit, model_type="siglip_vision_model", image_size=980, patch_size=14), f, indent=2)
    tokenizer.save_pretrained(out_dir)


def _tiny_weights(llm: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    mot = BagelMoT(
        **{k: llm[k] for k in keys},
        num_key_value_heads=llm["num_key_value_heads"],
        rope_theta=llm["rope_theta"],
        max_position_embeddings=llm["max_position_embeddings"],
        latent_channels=TINY_AE["z_channels"],
        max_latent_size=MAX_LATENT_SIZE,
    )
    state = mot.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            if "norm" in name:  # RMS norm gains near 1, as trained ones are
                value.copy_(1 + 0.1 * torch.randn_like(value))
            elif name.endswith("bias"):
                value.copy_(0.05 * torch.randn_like(value))
        for name, value in state.items():  # the generation expert: a perturbed copy (BAGEL's init_moe)
            if "_moe_gen" in name:
                source = state[name.replace("_moe_gen", "")]
                value.copy_(source + 0.1 * source.abs().mean() * torch.randn_like(source))
        # upstream zero-initialises llm2vae; random here so the velocity is not 0
        state["llm2vae.weight"].copy_(0.3 * torch.randn_like(state["llm2vae.weight"]))
    ema = {k: v.contiguous() for k, v in state.items()}
    ema["language_model.lm_head.weight"] = 0.02 * torch.randn(llm["vocab_size"], llm["hidden_size"])
    vae = vae_from_params(TINY_AE)
    vae_state = diffusers_vae_to_bfl({k: v.contiguous() for k, v in vae.state_dict().items()}, len(TINY_AE["ch_mult"]))
    return ema, vae_state
