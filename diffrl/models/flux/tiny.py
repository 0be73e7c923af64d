"""Tiny FluxPipeline (arch "flux"): FLUX.1-dev's layout at toy size, random weights.

Kept from the real model: CLIP-L text model (pooled output) + T5 v1.1 encoder, a 16-channel VAE with
scale factor 8 and FLUX's shift/scaling factors, 2x2-packed latents (64 channels per token), double-
and single-stream blocks with 3-axis RoPE, a guidance embedding (guidance-distilled, like FLUX.1-dev),
and the dynamically shifted flow-matching scheduler. A 64x64 image is 4x4 = 16 packed image tokens.
"""

from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel

from diffrl.models.sd3.tiny import tiny_t5, tiny_vae
from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import clip_tokenizer, t5_tokenizer

CLIP_DIM, T5_DIM = 16, 32


@register_tiny("flux")
def build_flux(out_dir: str, seed: int) -> None:
    """Build the tiny FLUX pipeline (seeded random weights) and save it to out_dir."""
    torch.manual_seed(seed)
    tiny_flux_pipeline().save_pretrained(out_dir, safe_serialization=True)


def tiny_flux_pipeline() -> FluxPipeline:
    """The tiny FluxPipeline, its weights drawn from torch's global generator."""
    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=CLIP_DIM,
            intermediate_size=2 * CLIP_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=tokenizer.model_max_length,
            hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    text_encoder_2 = tiny_t5(tokenizer_2, T5_DIM)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_DIM,
        pooled_projection_dim=CLIP_DIM,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    vae = tiny_vae(16, shift_factor=0.1159, scaling_factor=0.3611)
    # FLUX.1-dev's scheduler config: resolution-dependent (dynamic) shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
