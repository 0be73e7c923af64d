"""Tiny offline Janus-Pro: transformers' ``JanusForConditionalGeneration`` at tiny size with random weights, a
byte-level BPE tokenizer built in memory with Janus' special tokens, and its image processor; a Hugging Face folder
(safetensors) that diffrl/models/janus/policy.py loads and `generate(..., generation_mode="image")` samples.

Sizes: a 2-layer Llama language model (hidden 64), a 1-layer SigLIP-style vision encoder, a VQ-VAE with a 256-entry
codebook whose decoder upsamples 4x4 image tokens (16 per image) by 16 to 64x64 pixels. Janus-Pro-1B/7B: 576 tokens
(24x24) decoded to 384x384 by the same VQ architecture with a 16384-entry codebook.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, JanusConfig, JanusForConditionalGeneration
from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

# Janus' special tokens (the names of deepseek-ai/Janus-Pro's tokenizer), and the attributes JanusProcessor reads
JANUS_SPECIALS = {
    "bos_token": "<｜begin▁of▁sentence｜>",
    "pad_token": "<｜▁pad▁｜>",
    "image_token": "<image_placeholder>",
    "boi_token": "<begin_of_image>",
    "eoi_token": "<end_of_image>",
}
TINY_IMAGE_SIZE = 64
TINY_GRID = 4  # image tokens per side: 16 per image


def janus_tokenizer():
    """The Qwen-style BPE tokenizer of diffrl's tiny models with Janus' specials (BOS, pad, image placeholder,
    begin/end of image), each an attribute of the tokenizer as JanusProcessor reads them."""
    tokenizer = qwen_tokenizer(named_specials=JANUS_SPECIALS)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_janus_config(tokenizer) -> JanusConfig:
    """The tiny JanusConfig: Llama text model, vision encoder and VQ-VAE at tiny size (16 image tokens, 64x64)."""
    hidden = 64
    text = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": TINY_IMAGE_SIZE,
        "patch_size": TINY_IMAGE_SIZE // TINY_GRID,
        "mlp_ratio": 2.0,
        "projection_dim": hidden,
        "depth": 2,
        "num_image_tokens": TINY_GRID * TINY_GRID,
    }
    vq = {
        "embed_dim": 8,
        "num_embeddings": 256,
        "latent_channels": 32,
        "base_channels": 32,  # GroupNorm(32) needs channels in multiples of 32
        "channel_multiplier": [1, 1, 1, 1, 1],  # 5 levels: 4 upsamplings, 4x4 tokens -> 64x64 pixels
        "num_res_blocks": 1,
        "projection_dim": hidden,
        "image_token_embed_dim": hidden,
        "num_hidden_layers": 2,
    }
    return JanusConfig(
        text_config=text,
        vision_config=vision,
        vq_config=vq,
        image_token_id=tokenizer.convert_tokens_to_ids(JANUS_SPECIALS["image_token"]),
    )


def janus_generation_config(tokenizer, model: JanusForConditionalGeneration, guidance_scale: float = 5.0):
    """The generation config Janus' image generation reads: BOS, pad, begin-of-image ids and the CFG scale."""
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.config.text_config.eos_token_id,
        guidance_scale=guidance_scale,
        generation_kwargs={"boi_token_id": tokenizer.convert_tokens_to_ids(JANUS_SPECIALS["boi_token"])},
    )


def save_janus_folder(
    out_dir: str, model: JanusForConditionalGeneration, tokenizer, guidance_scale: float = 5.0
) -> None:
    """Write a Janus folder: weights (safetensors), tokenizer, image processor (64x64, mean/std 0.5) and the
    generation config of `janus_generation_config`."""
    model.generation_config = janus_generation_config(tokenizer, model, guidance_scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    JanusImageProcessorPil(
        size={"height": TINY_IMAGE_SIZE, "width": TINY_IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out_dir)


@register_tiny("janus")
def build_janus(out_dir: str, seed: int) -> None:
    """Tiny JanusForConditionalGeneration folder with random weights (save_janus_folder: CFG scale 5)."""
    tokenizer = janus_tokenizer()
    config = tiny_janus_config(tokenizer)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = JanusForConditionalGeneration(config).eval()
    save_janus_folder(out_dir, model, tokenizer)
