"""Tiny offline LTX-2 text-to-audio-video pipeline ("ltx2"): every LTX2Pipeline component at toy size.

Real layouts: a Gemma-3 text encoder (Gemma3ForConditionalGeneration with a tiny SigLIP tower, as the real one
carries) with the in-memory Gemma tokenizer (diffrl/models/tokenizers.py), LTX2TextConnectors with learnable
registers, LTX2VideoTransformer3DModel, the video VAE at LTX-2's real compression (spatial 32 = patch 4 x three 2x
downsamplings, temporal 8), the audio VAE (mel bins / 4, 25 latent frames a second at 16 kHz) and the LTX2Vocoder,
with LTX-2's scheduler settings (resolution-dependent shift, terminal sigma 0.1). Video and audio latent tokens both
have 4 channels, as both have 128 at real size. Non-trivial latent statistics in both VAEs so that decoding
exercises the (de)normalisation. Weights ~0.7 MB.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import gemma_tokenizer

_TEXT_DIM, _TEXT_LAYERS = 32, 2
_LATENT_CHANNELS = 4  # video latent channels = audio latent channels x latent mel bins (2 x 2)
_TEXT_OUTPUT_GAIN = 4.0  # with the cross-attention gain: the prompt visibly steers both streams (parity then
_CROSS_ATTN_GAIN = 12.0  # tests CFG too); at random init the text moves the velocities by ~1 % otherwise
_MEL_GAIN, _VOCODER_GAIN = 8.0, 8.0  # the random audio VAE and vocoder map any latents to nearly the same waveform
_UPSAMPLE_GAIN = 2.0  # (a constant offset of the vocoder's last bias); these let the audio latents be heard

# LTX-2's scheduler (what LTX2Pipeline reads: mu from the video token count between 1024 and 4096 tokens, shift 0.95
# to 2.05, exponential time shift), with the schedule stretched to end at sigma 0.1 before the final 0 as Lightricks'
# LTXVScheduler (terminal 0.1) does.
LTX2_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
    time_shift_type="exponential",
)


def _text_encoder(vocab_size: int) -> Gemma3ForConditionalGeneration:
    """A 2-layer Gemma-3 with a 1-layer SigLIP tower (unused for text prompts; the real text encoder has one)."""
    config = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=_TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=_TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=16,
            max_position_embeddings=2048,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=vocab_size - 3,
        eoi_token_index=vocab_size - 2,
        image_token_index=vocab_size - 1,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.norm.weight.add_(_TEXT_OUTPUT_GAIN)  # Gemma's RMSNorm scales by 1 + weight
    return model


def _video_vae() -> AutoencoderKLLTX2Video:
    """LTX-2's video VAE layout at toy width: patch 4, four levels (spatial, temporal, two spatio-temporal)."""
    vae = AutoencoderKLLTX2Video(
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(4, 4, 4, 4),
        decoder_block_out_channels=(4, 8, 16),  # LTX-2 (256, 512, 1024) / 64: each upsampler halves the width
        upsample_residual=(False, False, False),  # LTX-2's residual upsampling needs widths divisible by 8
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        decoder_causal=False,
        # as the LTX-2 folder's config says (the class default derives 64 / 16 from the four scaling levels)
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.05, 0.3]))
        vae.latents_std.copy_(torch.tensor([1.5, 0.8, 1.2, 2.0]))
    return vae


def _audio_vae() -> AutoencoderKLLTX2Audio:
    """LTX-2's audio VAE at toy width: 2 latent channels x 8 mel bins / 4 = 4 values per latent audio frame."""
    vae = AutoencoderKLLTX2Audio(
        base_channels=4, ch_mult=(1,), num_res_blocks=1, resolution=32, latent_channels=2, mel_bins=8
    )
    with torch.no_grad():
        vae.latents_mean.copy_(torch.tensor([0.2, -0.1, 0.0, 0.4]))
        vae.latents_std.copy_(torch.tensor([0.9, 1.3, 1.1, 0.7]))
        vae.decoder.conv_out.conv.weight.mul_(_MEL_GAIN)
    return vae


def _vocoder(in_channels: int) -> LTX2Vocoder:
    """LTX2Vocoder at toy width; 100 mel frames a second (16 kHz / hop 160) x 80 = 8 kHz, so the waveform lasts as
    long as the video, as LTX-2's 240x upsampling to 24 kHz does."""
    vocoder = LTX2Vocoder(
        in_channels=in_channels,
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[10, 8, 8],
        upsample_factors=[5, 4, 4],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=8000,
    )
    with torch.no_grad():
        vocoder.conv_in.weight.mul_(_VOCODER_GAIN)
        for upsampler in vocoder.upsamplers:
            upsampler.weight.mul_(_UPSAMPLE_GAIN)
        vocoder.conv_out.bias.zero_()
    return vocoder


@register_tiny("ltx2")
def build_ltx2(out_dir: str, seed: int) -> None:
    """Tiny LTX2Pipeline (LTX-2.0 layout): Gemma-3, connectors, a 2-block audio-video transformer, both VAEs and the
    vocoder, all seeded."""
    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer()
    text_encoder = _text_encoder(len(tokenizer) + 3)
    # LTX-2.0 connectors work at the text width: heads x head dim = caption_channels (30 x 128 = 3840 at real size)
    connectors = LTX2TextConnectors(
        caption_channels=_TEXT_DIM,
        text_proj_in_factor=_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32,
    )
    transformer = LTX2VideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=_LATENT_CHANNELS,
        audio_out_channels=_LATENT_CHANNELS,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        caption_channels=_TEXT_DIM,
    )
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn2.to_out[0].weight.mul_(_CROSS_ATTN_GAIN)
            block.audio_attn2.to_out[0].weight.mul_(_CROSS_ATTN_GAIN)
    audio_vae = _audio_vae()
    vocoder = _vocoder(audio_vae.config.output_channels * audio_vae.config.mel_bins)
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER),
        vae=_video_vae(),
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
