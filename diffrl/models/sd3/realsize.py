"""SD3.5-Medium at real size with random weights (`diffrl random-model sd35m`): the published configs of
stabilityai/stable-diffusion-3.5-medium (each with its source) and the plan diffrl/models/realsize.py writes.

The CLIP and T5 tokenizers are diffrl's in-memory ones (diffrl/models/tokenizers.py) with the real special tokens;
every token id stays below the real vocabulary size. Checked in bf16 on the CPU with the modules' own init: the
real-size transformer, T5-XXL, both CLIPs and the VAE give finite outputs (std 0.2-1).
"""

from __future__ import annotations

from diffrl.models.realsize import Plan, merged, register_plan

# ---- stabilityai/stable-diffusion-3.5-medium ------------------------------------------------------
# transformer/config.json (MMDiT-X: dual attention in blocks 0-12, RMS q/k norm, 384x384 positional-embedding table).
SD35M_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# vae/config.json.
SD35M_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# scheduler/scheduler_config.json.
SD35M_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
# text_encoder: OpenAI CLIP ViT-L/14 text tower with projection. The config.json published with the SD3 /
# FLUX.1 / SDXL diffusers folders (e.g. black-forest-labs/FLUX.1-schnell text_encoder/config.json):
# 12 layers, width 768, MLP 3072, 12 heads, quick_gelu, 77 positions, vocab 49408, projection 768.
CLIP_L_TEXT = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    initializer_range=0.02,
    initializer_factor=1.0,
)
# text_encoder_2: OpenCLIP ViT-bigG/14 text tower with projection (the SDXL text_encoder_2/config.json,
# which SD3 reuses): 32 layers, width 1280, MLP 5120, 20 heads, gelu, projection 1280.
CLIP_BIGG_TEXT = dict(
    vocab_size=49408,
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    max_position_embeddings=77,
    projection_dim=1280,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
    initializer_range=0.02,
    initializer_factor=1.0,
)
# text_encoder_3: google/t5-v1_1-xxl encoder (black-forest-labs/FLUX.1-schnell text_encoder_2/config.json,
# the same T5EncoderModel SD3 ships): d_model 4096, d_ff 10240 gated-gelu, 24 layers, 64 heads of 64,
# 32 relative-position buckets up to distance 128, vocab 32128.
T5_XXL_ENCODER = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    initializer_factor=1.0,
    is_encoder_decoder=False,
    tie_word_embeddings=False,
)


@register_plan("sd35m")
def sd35m_plan(scale: dict[str, dict] | None = None) -> Plan:
    """StableDiffusion3Pipeline at SD3.5-Medium size (or scaled by `scale`), random weights."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from diffrl.models.tokenizers import clip_tokenizer, t5_tokenizer

    scale = scale or {}
    # SD3's tokenizer_2 pads with "!" (CLIP-G), tokenizer with <|endoftext|> (CLIP-L), as upstream.
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(pad_token="!"), t5_tokenizer()
    transformer = merged(SD35M_TRANSFORMER, scale.get("transformer"))
    vae = merged(SD35M_VAE, scale.get("vae"))
    clip_l = merged(CLIP_L_TEXT, scale.get("text_encoder"))
    clip_g = merged(CLIP_BIGG_TEXT, scale.get("text_encoder_2"))
    t5 = merged(T5_XXL_ENCODER, scale.get("text_encoder_3"))
    _check_sd35m(transformer, vae, clip_l, clip_g, t5, [tokenizer, tokenizer_2, tokenizer_3])
    t5_ids = dict(
        pad_token_id=tokenizer_3.pad_token_id,
        eos_token_id=tokenizer_3.eos_token_id,
        decoder_start_token_id=tokenizer_3.pad_token_id,
    )
    return Plan(
        pipeline_class=StableDiffusion3Pipeline,
        models={
            "transformer": lambda: SD3Transformer2DModel(**transformer),
            "vae": lambda: AutoencoderKL(**vae),
            "text_encoder": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**clip_l, **_clip_ids(tokenizer))),
            "text_encoder_2": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**clip_g, **_clip_ids(tokenizer_2))),
            "text_encoder_3": lambda: T5EncoderModel(T5Config(**t5, **t5_ids)),
        },
        small={
            "tokenizer": tokenizer,
            "tokenizer_2": tokenizer_2,
            "tokenizer_3": tokenizer_3,
            "scheduler": FlowMatchEulerDiscreteScheduler(**SD35M_SCHEDULER),
        },
    )


def _clip_ids(tokenizer) -> dict:
    # Our tokenizer's ids. With eos_token_id != 2, CLIP pools at the first <|endoftext|> (the published
    # configs' eos 2 selects the legacy argmax pooling, which needs <|endoftext|> to be the largest id).
    return dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


def _check_sd35m(transformer: dict, vae: dict, clip_l: dict, clip_g: dict, t5: dict, tokenizers: list) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    if transformer["joint_attention_dim"] != t5["d_model"]:
        raise ValueError(
            f"transformer.joint_attention_dim={transformer['joint_attention_dim']} must equal "
            f"text_encoder_3.d_model={t5['d_model']}"
        )
    if transformer["pooled_projection_dim"] != clip_l["projection_dim"] + clip_g["projection_dim"]:
        raise ValueError("transformer.pooled_projection_dim must equal the sum of both CLIP projection_dim")
    if clip_l["hidden_size"] + clip_g["hidden_size"] > t5["d_model"]:
        raise ValueError("the two CLIP hidden sizes must sum to at most text_encoder_3.d_model (zero-padded to it)")
    if transformer["in_channels"] != vae["latent_channels"]:
        raise ValueError("transformer.in_channels must equal vae.latent_channels")
    for tok, vocab in zip(tokenizers, (clip_l["vocab_size"], clip_g["vocab_size"], t5["vocab_size"])):
        assert len(tok) <= vocab, "in-memory tokenizer larger than the text encoder's vocabulary"
