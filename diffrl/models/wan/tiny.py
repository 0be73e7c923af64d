"""Tiny offline Wan pipelines: Wan2.1 layout ("wan"), the two-expert Wan2.2 layout ("wan22") and Wan2.2 A14B
image-to-video ("wan_i2v").

Real layouts at toy size: UMT5 text encoder with the in-memory T5/UMT5 Unigram tokenizer, a 3-level
AutoencoderKLWan (spatial factor 8, temporal factor 4), WanTransformer3DModel with patch (1, 2, 2).
Real Wan folders ship `UniPCMultistepScheduler` (flow_shift 3.0 for Wan2.1 480P); our sampler steps
with flow-matching Euler/SDE on the flow sigmas, so these folders ship `FlowMatchEulerDiscreteScheduler`
with Wan's shift, which makes the upstream pipeline itself run Euler and parity checkable.
Wan2.2 A14B: boundary_ratio 0.875 and shift 12.0 (the original repo's t2v-A14B sample_shift).
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import UMT5Config, UMT5EncoderModel

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import t5_tokenizer

_Z_DIM, _TEXT_DIM = 4, 32
_TEXT_OUTPUT_GAIN = 25.0  # default-init UMT5 outputs have std ~0.14; ~3.5 after this gain
_CROSS_ATTN_QK_GAIN = 2.0
_CONDITION_GAIN = 6.0  # image-to-video: the first frame's channels at random init barely move the output otherwise
_ENCODER_GAIN = 20.0  # and the random VAE encoder maps different frames to nearly the same latents


def _transformer(in_channels: int = _Z_DIM) -> WanTransformer3DModel:
    """A 2-block WanTransformer3DModel; `in_channels` > z for image-to-video (mask and condition channels)."""
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=in_channels,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    # Wan's text has no mask: ~500 zero-padded tokens share the attention with a handful of real ones.
    # Sharper cross-attention (larger q/k RMSNorm gains) lets the prompt, and so CFG, visibly change
    # the tiny model's output; otherwise parity tests could not tell guidance apart from none.
    with torch.no_grad():
        for block in model.blocks:
            block.attn2.norm_q.weight.mul_(_CROSS_ATTN_QK_GAIN)
            block.attn2.norm_k.weight.mul_(_CROSS_ATTN_QK_GAIN)
    return model


def _components(seed: int) -> dict:
    """Tokenizer, UMT5 encoder and VAE shared by both layouts (seeded)."""
    torch.manual_seed(seed)
    tokenizer = t5_tokenizer()
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=_TEXT_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()
    with torch.no_grad():  # see _transformer: make the prompt matter at random init
        text_encoder.encoder.final_layer_norm.weight.mul_(_TEXT_OUTPUT_GAIN)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=_Z_DIM,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        # Non-trivial normalisation so decode's latents_mean/latents_std handling is exercised.
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae}


@register_tiny("wan")
def build_wan(out_dir: str, seed: int) -> None:
    """Tiny Wan2.1 WanPipeline: one 2-block expert, Euler scheduler with shift 3.0."""
    parts = _components(seed)
    transformer = _transformer()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = WanPipeline(**parts, scheduler=scheduler, transformer=transformer)
    pipe.save_pretrained(out_dir, safe_serialization=True)


@register_tiny("wan22")
def build_wan22(out_dir: str, seed: int) -> None:
    """Tiny Wan2.2 (A14B layout) WanPipeline: high-noise `transformer` + low-noise `transformer_2`,
    boundary_ratio 0.875, Euler scheduler with shift 12.0."""
    parts = _components(seed)
    transformer, transformer_2 = _transformer(), _transformer()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=12.0)
    pipe = WanPipeline(
        **parts, scheduler=scheduler, transformer=transformer, transformer_2=transformer_2, boundary_ratio=0.875
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)


@register_tiny("wan_i2v")
def build_wan_i2v(out_dir: str, seed: int) -> None:
    """Tiny Wan2.2 A14B image-to-video WanImageToVideoPipeline: no image encoder, two experts taking 4 mask + 2 x 4
    latent channels, boundary_ratio 0.9 (Wan2.2-I2V-A14B's), Euler scheduler with shift 5.0 (the original repo's
    i2v-A14B sample_shift)."""
    parts = _components(seed)
    in_channels = parts["vae"].config.scale_factor_temporal + 2 * _Z_DIM
    experts = [_transformer(in_channels), _transformer(in_channels)]
    with torch.no_grad():  # as the cross-attention gain: let the mask and first-frame latents visibly steer the video
        for expert in experts:
            expert.patch_embedding.weight[:, _Z_DIM:].mul_(_CONDITION_GAIN)
        parts["vae"].quant_conv.weight[:_Z_DIM].mul_(_ENCODER_GAIN)  # the posterior mean's channels
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    pipe = WanImageToVideoPipeline(
        **parts, scheduler=scheduler, transformer=experts[0], transformer_2=experts[1], boundary_ratio=0.9
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
