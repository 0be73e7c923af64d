"""HunyuanVideo-1.5 480p text-to-video at real size with random weights (`diffrl random-model hunyuan_video15_480p`):
the plan diffrl/models/realsize.py writes.

The layout of hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v as diffusers' conversion script builds it
(huggingface/diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py, transformer type "480p_t2v"): the 54-block
HunyuanVideo15Transformer3DModel, AutoencoderKLHunyuanVideo15 with its defaults, Qwen2.5-VL-7B-Instruct's language
model (`text_encoder`), Glyph-SDXL-v2's byT5-small encoder (`text_encoder_2`), FlowMatchEuler with shift 5.0 and
ClassifierFreeGuidance at 6.0. The 720p T2V folder differs in target_size 960 and shift 9.0 only.

Parameter counts (meta device; tests/models/test_realsize_hunyuan_video15.py): transformer 8,326,608,160 (the model
card's "8.3B"), VAE 1,260,634,115, Qwen2.5-VL-7B's language model 7,070,619,136 (the published 8,292,166,656 less
the 676,550,144 of the vision tower and the 544,997,376 of lm_head), byT5-small's encoder 217,657,472: 16.88 B
values, ~33.8 GB in bf16, which a 64 GB disk holds. The tokenizers: diffrl's in-memory Qwen BPE with the real special
tokens and Qwen2.5-VL's chat rendering (its template prefix is the 108 tokens the pipeline crops, every id below
Qwen's 152,064) and transformers' ByT5Tokenizer, which needs no vocabulary file; Glyph-SDXL-v2's added color and font
tokens are not in it, so the glyph encoder's embedding keeps byT5-small's 384 rows.
"""

from __future__ import annotations

from diffrl.models.qwen_image.realsize import QWEN25_VL_7B
from diffrl.models.realsize import Plan, merged, register_plan

# transformer/config.json: the script's TRANSFORMER_CONFIGS["480p_t2v"].
HV15_480P_T2V_TRANSFORMER = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=54,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    use_meanflow=False,
    target_size=640,
    task_type="t2v",
)
# vae/config.json: the script's convert_vae() builds AutoencoderKLHunyuanVideo15() with its defaults (32 latent
# channels, 16x spatial and 4x temporal compression, scaling_factor 1.03682).
HV15_VAE: dict = {}
# text_encoder/config.json: the script's load_mllm() keeps AutoModel.from_pretrained("Qwen/Qwen2.5-VL-7B-Instruct")
# .language_model, a Qwen2_5_VLTextModel of Qwen2.5-VL-7B's text config (the same numbers as Qwen-Image's encoder).
QWEN25_VL_7B_TEXT = QWEN25_VL_7B["text_config"]
# text_encoder_2/config.json: google/byt5-small's encoder (the script's load_byt5(), T5EncoderModel.from_pretrained
# ("google/byt5-small") with Glyph-SDXL-v2's weights): d_model 1472, d_ff 3584 gated-gelu, 12 layers, 6 heads of 64,
# 32 relative-position buckets up to 128, byte vocabulary 384.
BYT5_SMALL_ENCODER = dict(
    vocab_size=384,
    d_model=1472,
    d_kv=64,
    d_ff=3584,
    num_layers=12,
    num_heads=6,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.1,
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
# scheduler/scheduler_config.json and guider/config.json: SCHEDULER_CONFIGS / GUIDANCE_CONFIGS["480p_t2v"].
HV15_480P_SHIFT, HV15_GUIDANCE_SCALE = 5.0, 6.0


@register_plan("hunyuan_video15_480p")
def hunyuan_video15_480p_plan(scale: dict[str, dict] | None = None) -> Plan:
    """HunyuanVideo15Pipeline at HunyuanVideo-1.5 480p T2V size (or scaled by `scale`), random weights."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from diffrl.models.hunyuan_video15.tiny import hunyuan_video15_tokenizer
    from diffrl.models.tokenizers import ENDOFTEXT, IM_END

    scale = scale or {}
    tokenizer, tokenizer_2 = hunyuan_video15_tokenizer(), ByT5Tokenizer()
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
    }  # Qwen's: <|endoftext|>, <|im_end|>
    transformer = merged(HV15_480P_T2V_TRANSFORMER, scale.get("transformer"))
    vae = merged(HV15_VAE, scale.get("vae"))
    text = merged(merged(QWEN25_VL_7B_TEXT, ids), scale.get("text_encoder"))
    glyph = merged(BYT5_SMALL_ENCODER, scale.get("text_encoder_2"))
    _check_widths(transformer, vae, text, glyph, tokenizer, tokenizer_2)
    return Plan(
        pipeline_class=HunyuanVideo15Pipeline,
        models={
            "transformer": lambda: HunyuanVideo15Transformer3DModel(**transformer),
            "vae": lambda: AutoencoderKLHunyuanVideo15(**vae),
            "text_encoder": lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**text)),
            "text_encoder_2": lambda: T5EncoderModel(T5Config(**glyph)),
        },
        small={
            "tokenizer": tokenizer,
            "tokenizer_2": tokenizer_2,
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=HV15_480P_SHIFT),
            "guider": ClassifierFreeGuidance(guidance_scale=HV15_GUIDANCE_SCALE),
        },
    )


def _check_widths(transformer: dict, vae: dict, text: dict, glyph: dict, tokenizer, tokenizer_2) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    latent = vae.get("latent_channels", 32)  # AutoencoderKLHunyuanVideo15's default
    if transformer["in_channels"] != 2 * latent + 1 or transformer["out_channels"] != latent:
        raise ValueError(
            f"transformer in_channels must be 2 x the VAE's latent_channels + 1 = {2 * latent + 1} and out_channels "
            f"{latent}; got {transformer['in_channels']} and {transformer['out_channels']}"
        )
    for name, width, encoder in (("text_embed_dim", "hidden_size", text), ("text_embed_2_dim", "d_model", glyph)):
        if transformer[name] != encoder[width]:
            raise ValueError(
                f"transformer.{name}={transformer[name]} must equal its encoder's {width}={encoder[width]}"
            )
    assert len(tokenizer) <= text["vocab_size"] and len(tokenizer_2) <= glyph["vocab_size"], "tokenizer too large"
