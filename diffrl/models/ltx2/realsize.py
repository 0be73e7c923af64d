"""LTX-2 (Lightricks/LTX-2, the LTX-2.0 dev model) at real size with random weights (`diffrl random-model ltx2`): the
plan diffrl/models/realsize.py writes.

The layout of an LTX2Pipeline folder: the audio-video LTX2VideoTransformer3DModel (48 blocks, a 4096-wide video
stream and a 2048-wide audio stream), LTX2TextConnectors, the video VAE (AutoencoderKLLTX2Video), the audio VAE
(AutoencoderKLLTX2Audio), the LTX2Vocoder (24 kHz) and the Gemma-3-12B text encoder (Gemma3ForConditionalGeneration,
its SigLIP tower included) with its tokenizer. The numbers below are the ones diffusers' conversion script
(scripts/convert_ltx2_to_diffusers.py, version "2.0") builds the folder with, each with its source.

Size (meta-device parameter counts, tests/models/test_realsize_ltx2.py): transformer 18,876,174,592 (the "19B" of the
model card: a ~14 B video and a ~5 B audio stream), connectors 1,431,475,200, video VAE 1,222,479,601, audio VAE
53,248,146, vocoder 55,592,802, Gemma-3-12B 12,187,325,040 (the published 12.2 B): 33,826,295,381 parameters, ~67.7 GB
in bf16. The GPU machine's 64 GB disk cannot hold the written folder: write the configs only
(`--configs-only`) and train with `model.path=random:<folder>`, which builds the weights in memory
(diffrl/models/random_weights.py).

The tokenizer is diffrl's in-memory Gemma one (diffrl/models/tokenizers.py), its ids below Gemma-3's vocabulary; the
compute does not depend on it: LTX-2 pads every prompt to max_sequence_length (1024) tokens.
"""

from __future__ import annotations

from diffrl.models.realsize import Plan, merged, register_plan

# transformer/config.json: get_ltx2_transformer_config("2.0") of the conversion script (the LTX2VideoTransformer3DModel
# defaults): 32 x 128 video heads over 48 blocks, 32 x 64 audio heads, cross-attention widths 4096 / 2048, Gemma-3's
# 3840-wide captions, 128 latent channels in both streams. 18,876,174,592 parameters.
LTX2_TRANSFORMER = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    causal_offset=1,
)
# connectors/config.json: get_ltx2_text_encoder_config("2.0"): Gemma-3-12B's 49 hidden states (48 layers + the
# embeddings) of 3840 projected to 3840, then two 2-block connectors of 30 x 128 heads with 128 learnable registers
# each. 1,431,475,200 parameters.
LTX2_CONNECTORS = dict(
    caption_channels=3840,
    text_proj_in_factor=49,
    video_connector_num_attention_heads=30,
    video_connector_attention_head_dim=128,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=128,
    audio_connector_num_attention_heads=30,
    audio_connector_attention_head_dim=128,
    audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=128,
    connector_rope_base_seq_len=4096,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_temporal_positioning=False,
)
# vae/config.json: get_ltx2_video_vae_config("2.0"): 128 latent channels, patch 4, spatial 32 / temporal 8.
LTX2_VIDEO_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    block_out_channels=(256, 512, 1024, 2048),
    down_block_types=("LTX2VideoDownBlock3D",) * 4,
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)
# audio_vae/config.json: AutoencoderKLLTX2Audio's defaults, which are LTX-2's (8 latent channels over 64 mel bins / 4,
# 16 kHz, hop 160: 25 latent audio frames a second, 8 x 16 = 128 values each).
LTX2_AUDIO_VAE = dict(
    base_channels=128,
    output_channels=2,
    ch_mult=(1, 2, 4),
    num_res_blocks=2,
    latent_channels=8,
    mel_bins=64,
    sample_rate=16000,
    mel_hop_length=160,
)
# vocoder/config.json: get_ltx2_vocoder_config("2.0"): 128 mel features (2 channels x 64 bins) upsampled 240x
# (6 x 5 x 2 x 2 x 2) to 24 kHz stereo.
LTX2_VOCODER = dict(
    in_channels=128,
    hidden_channels=1024,
    out_channels=2,
    upsample_kernel_sizes=[16, 15, 8, 4, 4],
    upsample_factors=[6, 5, 2, 2, 2],
    resnet_kernel_sizes=[3, 7, 11],
    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    leaky_relu_negative_slope=0.1,
    output_sampling_rate=24000,
)
# text_encoder/config.json: google/gemma-3-12b-it (the conversion script's text encoder,
# gemma-3-12b-it-qat-q4_0-unquantized, has its config): 48 layers of 3840, 16 heads / 8 KV heads of 256, MLP 15360,
# sliding window 1024, vocab 262208; a 27-layer SigLIP-So400m tower at 896 px and 256 image tokens.
GEMMA3_12B_TEXT = dict(
    vocab_size=262208,
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    query_pre_attn_scalar=256,
    sliding_window=1024,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
)
GEMMA3_12B_VISION = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=896,
    patch_size=14,
    vision_use_head=False,
)
GEMMA3_12B = dict(mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144)


@register_plan("ltx2")
def ltx2_plan(scale: dict[str, dict] | None = None) -> Plan:
    """LTX2Pipeline at LTX-2 (19B) size (or scaled by `scale`: "transformer", "connectors", "vae", "audio_vae",
    "vocoder", "text_encoder" with nested "text_config" / "vision_config"), random weights."""
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

    from diffrl.models.ltx2.tiny import LTX2_SCHEDULER
    from diffrl.models.tokenizers import gemma_tokenizer

    scale = scale or {}
    tokenizer = gemma_tokenizer()
    transformer = merged(LTX2_TRANSFORMER, scale.get("transformer"))
    connectors = merged(LTX2_CONNECTORS, scale.get("connectors"))
    text = merged(
        {**GEMMA3_12B, "text_config": GEMMA3_12B_TEXT, "vision_config": GEMMA3_12B_VISION}, scale.get("text_encoder")
    )
    _check_ltx2(transformer, connectors, text, tokenizer)
    return Plan(
        pipeline_class=LTX2Pipeline,
        models={
            "transformer": lambda: LTX2VideoTransformer3DModel(**transformer),
            "connectors": lambda: LTX2TextConnectors(**connectors),
            "vae": lambda: AutoencoderKLLTX2Video(**merged(LTX2_VIDEO_VAE, scale.get("vae"))),
            "audio_vae": lambda: AutoencoderKLLTX2Audio(**merged(LTX2_AUDIO_VAE, scale.get("audio_vae"))),
            "vocoder": lambda: LTX2Vocoder(**merged(LTX2_VOCODER, scale.get("vocoder"))),
            "text_encoder": lambda: Gemma3ForConditionalGeneration(Gemma3Config(**text)),
        },
        small={"tokenizer": tokenizer, "scheduler": FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER)},
    )


def _check_ltx2(transformer: dict, connectors: dict, text: dict, tokenizer) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    width, layers = text["text_config"]["hidden_size"], text["text_config"]["num_hidden_layers"]
    if connectors["caption_channels"] != width or connectors["text_proj_in_factor"] != layers + 1:
        raise ValueError(
            f"connectors caption_channels / text_proj_in_factor must be the text encoder's hidden_size {width} and "
            f"num_hidden_layers + 1 = {layers + 1}; got {connectors['caption_channels']} / "
            f"{connectors['text_proj_in_factor']}"
        )
    if transformer["caption_channels"] != width:
        raise ValueError(f"transformer.caption_channels={transformer['caption_channels']} must be {width}")
    assert len(tokenizer) <= text["text_config"]["vocab_size"], "in-memory tokenizer larger than Gemma's vocabulary"
