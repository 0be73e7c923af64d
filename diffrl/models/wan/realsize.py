"""Wan2.2 T2V A14B and I2V A14B at real size with random weights (`diffrl random-model wan22_a14b`, `wan22_i2v_a14b`):
the plans diffrl/models/realsize.py writes.

The layout of Wan-AI/Wan2.2-T2V-A14B-Diffusers: two WanTransformer3DModel experts of the same config (`transformer`
denoises timesteps >= boundary_ratio x 1000, `transformer_2` the rest), AutoencoderKLWan (Wan2.1's VAE), the UMT5-XXL
encoder, a UniPC flow scheduler and `boundary_ratio` 0.875 in model_index.json. The numbers below are the ones
diffusers' conversion script builds that folder with (each with its source); tests/models/test_realsize_wan.py checks
the meta-device counts against the published weight indexes.

Wan-AI/Wan2.2-I2V-A14B-Diffusers is the same layout as a WanImageToVideoPipeline (no image encoder): its experts take
36 input channels (4 frame-mask + 16 first-frame latent + 16 noisy latent channels; the script's
"Wan2.2-I2V-14B-720p" config), `boundary_ratio` 0.9, the same VAE, text encoder and scheduler (flow_shift 3.0). Each
expert then has 20 x 5120 x 2 x 2 = 409,600 more patch-embedding weights: 14,288,901,184 parameters.

Size: 2 x 14.288 B (experts) + 5.681 B (UMT5-XXL) + 0.127 B (VAE) = 34.4 B values, ~68.8 GB in bf16. The GPU machine's
64 GB disk cannot hold the written folder, and `diffrl random-model` refuses it there through its disk check (before
writing anything): write the configs only (`--configs-only`, a few MB) and train with `model.path=random:<folder>`,
which builds the weights in memory on the GPU (diffrl/models/random_weights.py).

The tokenizer is diffrl's in-memory T5/UMT5 Unigram one (diffrl/models/tokenizers.py): UMT5's specials at their
ids (`<pad>` 0, `</s>` 1, `<unk>` 2) and `<extra_id_*>` sentinels, every id below UMT5's vocabulary. Its vocabulary is
small, so a prompt splits into more tokens than google/umt5-xxl's 256k pieces make; the compute does not change: Wan
pads every prompt to max_sequence_length (512) tokens for the encoder and the transformer's cross-attention.
"""

from __future__ import annotations

from diffrl.models.realsize import Plan, merged, register_plan

# ---- Wan-AI/Wan2.2-T2V-A14B-Diffusers ------------------------------------------------------------------------
# transformer/config.json = transformer_2/config.json: huggingface/diffusers scripts/convert_wan_to_diffusers.py,
# get_transformer_config("Wan2.2-T2V-A14B") (converted from Wan-AI/Wan2.2-T2V-A14B high_noise_model and
# low_noise_model); the same numbers as the original repo's wan/configs/wan_t2v_A14B.py (dim 5120, ffn_dim 13824,
# 40 heads, 40 layers, freq_dim 256, qk_norm, cross_attn_norm, eps 1e-6). 14,288,491,584 parameters each.
WAN22_A14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    added_kv_proj_dim=None,
)
# vae/config.json: the same script's convert_vae() builds AutoencoderKLWan() with its defaults (Wan2.1_VAE.pth:
# base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], 2 res blocks, temporal downsampling in the last two levels, Wan's
# per-channel latents_mean / latents_std). 126,892,531 parameters.
WAN_VAE: dict = {}
# text_encoder/config.json: google/umt5-xxl (the script loads UMT5EncoderModel.from_pretrained("google/umt5-xxl");
# its config.json as ComfyUI's umt5_config_xxl.json reproduces it): d_model 4096, d_ff 10240 gated-gelu, 24 layers,
# 64 heads of 64, a relative-position bias in every layer (32 buckets up to 128), vocab 256384. 5,680,910,336
# parameters (the published text_encoder index: 11,361,820,672 bytes in bf16).
UMT5_XXL_ENCODER = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.1,
    layer_norm_epsilon=1e-6,
    initializer_factor=1.0,
    tie_word_embeddings=False,
)
# scheduler/scheduler_config.json: the script's UniPCMultistepScheduler(prediction_type="flow_prediction",
# use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0) for a T2V model. (The original repo samples
# t2v-A14B with sample_shift 12.0; diffrl steps with flow-matching Euler/SDE on this scheduler's sigmas, see
# diffrl/models/wan/adapter.py.) At 16 steps, shift 3 puts 5 steps on the high-noise expert (timesteps >= 875), 11 on
# the other.
WAN22_SCHEDULER = dict(
    prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
)
# model_index.json: WanPipeline(..., boundary_ratio=0.875) for "Wan2.2" + "T2V" in the same script (the original
# repo's t2v-A14B `boundary` 0.875); expand_timesteps stays False (Wan2.2 TI2V-5B only).
WAN22_PIPELINE_CONFIG = {"boundary_ratio": 0.875, "expand_timesteps": False}
# Wan2.2-I2V-A14B: the same script's get_transformer_config("Wan2.2-I2V-14B-720p") (in_channels 36, the rest as T2V)
# and WanImageToVideoPipeline(..., boundary_ratio=0.9) for "I2V" without an image encoder (the original repo's
# i2v-A14B `boundary` 0.900).
WAN22_I2V_A14B_TRANSFORMER = {**WAN22_A14B_TRANSFORMER, "in_channels": 36}
WAN22_I2V_PIPELINE_CONFIG = {"boundary_ratio": 0.9, "expand_timesteps": False}


@register_plan("wan22_a14b")
def wan22_a14b_plan(scale: dict[str, dict] | None = None) -> Plan:
    """WanPipeline at Wan2.2 T2V A14B size (or scaled by `scale`), random weights.

    `scale["transformer"]` applies to both experts (the published experts share one config); "vae" and
    "text_encoder" scale those components.
    """
    from diffusers import WanPipeline

    return _two_expert_plan(WanPipeline, WAN22_A14B_TRANSFORMER, WAN22_PIPELINE_CONFIG, scale, condition_channels=0)


@register_plan("wan22_i2v_a14b")
def wan22_i2v_a14b_plan(scale: dict[str, dict] | None = None) -> Plan:
    """WanImageToVideoPipeline at Wan2.2 I2V A14B size (or scaled by `scale`, as wan22_a14b), random weights; no image
    encoder. A scaled transformer keeps in_channels = 4 mask + 2 x the VAE's z_dim."""
    from diffusers import WanImageToVideoPipeline

    return _two_expert_plan(
        WanImageToVideoPipeline, WAN22_I2V_A14B_TRANSFORMER, WAN22_I2V_PIPELINE_CONFIG, scale, condition_channels=4
    )


def _two_expert_plan(
    pipeline_class, transformer_config: dict, config: dict, scale: dict[str, dict] | None, *, condition_channels: int
) -> Plan:
    """A Wan2.2 A14B pipeline (two experts of one config); `condition_channels`: the frame mask's channels an
    image-to-video transformer takes besides two sets of latents (0: text-to-video, latents only)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from diffrl.models.tokenizers import t5_tokenizer

    scale = scale or {}
    tokenizer = t5_tokenizer()
    transformer = merged(transformer_config, scale.get("transformer"))
    vae = merged(WAN_VAE, scale.get("vae"))
    text = merged(UMT5_XXL_ENCODER, scale.get("text_encoder"))
    _check_wan22(transformer, vae, text, tokenizer, condition_channels)
    # google/umt5-xxl's ids, which our tokenizer shares: <pad> 0 (also the decoder start), </s> 1.
    ids = dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return Plan(
        pipeline_class=pipeline_class,
        models={
            "transformer": lambda: WanTransformer3DModel(**transformer),
            "transformer_2": lambda: WanTransformer3DModel(**transformer),
            "vae": lambda: AutoencoderKLWan(**vae),
            "text_encoder": lambda: UMT5EncoderModel(UMT5Config(**text, **ids)),
        },
        small={"tokenizer": tokenizer, "scheduler": UniPCMultistepScheduler(**WAN22_SCHEDULER)},
        config=dict(config),
    )


def _check_wan22(transformer: dict, vae: dict, text: dict, tokenizer, condition_channels: int) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    z_dim = vae.get("z_dim", 16)  # AutoencoderKLWan's default
    if transformer["text_dim"] != text["d_model"]:
        raise ValueError(
            f"transformer.text_dim={transformer['text_dim']} must equal text_encoder.d_model={text['d_model']}"
        )
    in_channels = z_dim if condition_channels == 0 else condition_channels + 2 * z_dim
    if transformer["in_channels"] != in_channels or transformer["out_channels"] != z_dim:
        raise ValueError(
            f"transformer in_channels must be {in_channels} and out_channels the VAE's z_dim={z_dim}; got "
            f"{transformer['in_channels']} and {transformer['out_channels']}"
        )
    for key in ("latents_mean", "latents_std"):
        if key in vae and len(vae[key]) != z_dim:
            raise ValueError(f"vae.{key} must have z_dim={z_dim} values, got {len(vae[key])}")
    assert len(tokenizer) <= text["vocab_size"], "in-memory tokenizer larger than the text encoder's vocabulary"
