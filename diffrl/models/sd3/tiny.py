"""Tiny StableDiffusion3Pipeline (arch "sd3"): SD3.5-Medium's layout at toy size, random weights.

Kept from the real model: three text encoders (CLIP-L and CLIP-G as CLIPTextModelWithProjection, T5 v1.1
encoder), CLIP hidden states narrower than T5's so `encode_prompt` zero-pads them to `joint_attention_dim`,
pooled projections = concat of both CLIP projections, a 16-channel VAE with scale factor 8 and SD3's
shift/scaling factors, patch size 2, RMS q/k norm and a dual-attention (MMDiT-X) first block as in
SD3.5-Medium, and the shift-3 flow-matching scheduler. A 64x64 image is 8x8 latents = 16 image tokens.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import clip_tokenizer, t5_tokenizer

CLIP_L_DIM, CLIP_G_DIM, T5_DIM = 16, 16, 40  # 16 + 16 < 40: CLIP states get zero-padded, as upstream


def tiny_clip(tokenizer, hidden_size: int, projection_dim: int, hidden_act: str) -> CLIPTextModelWithProjection:
    """A 2-layer CLIP text encoder with projection (hidden_states[-2] must exist) for this tokenizer."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection_dim,
        hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config).eval()


def tiny_t5(tokenizer, d_model: int) -> T5EncoderModel:
    """A 2-layer T5 v1.1-style (gated-gelu) encoder for this tokenizer."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def tiny_vae(latent_channels: int, *, shift_factor: float | None, scaling_factor: float) -> AutoencoderKL:
    """AutoencoderKL with 4 levels (scale factor 8, as the real VAEs) and 4-8 channels per level."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 8, 8),
        layers_per_block=1,
        norm_num_groups=2,
        sample_size=64,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


@register_tiny("sd3")
def build_sd3(out_dir: str, seed: int) -> None:
    """Build the tiny SD3 pipeline (seeded random weights) and save it to out_dir."""
    torch.manual_seed(seed)
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer()
    text_encoder = tiny_clip(tokenizer, CLIP_L_DIM, CLIP_L_DIM, "quick_gelu")
    text_encoder_2 = tiny_clip(tokenizer_2, CLIP_G_DIM, CLIP_G_DIM, "gelu")
    text_encoder_3 = tiny_t5(tokenizer_3, T5_DIM)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=T5_DIM,
        caption_projection_dim=32,
        pooled_projection_dim=CLIP_L_DIM + CLIP_G_DIM,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    vae = tiny_vae(16, shift_factor=0.0609, scaling_factor=1.5305)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
