"""Stable Audio 3 Medium at real size with random weights (`diffrl random-model stable_audio3_medium`): the plan
diffrl/models/realsize.py writes.

The layout of stabilityai/stable-audio-3-medium (StableAudio3Pipeline's example): a StableAudio3DiTModel, the SAME-L
autoencoder (AutoencoderSAME), the T5Gemma B encoder (`google/t5gemma-b-b-ul2`, the pipeline's text_encoder
docstring) behind a Gemma tokenizer, the StableAudio3DurationEmbedder and a FlowMatchEulerDiscreteScheduler. Each
number below names its source; tests/models/test_stable_audio3.py counts the built modules on the meta device.

The tokenizer is diffrl's in-memory Gemma BPE (diffrl/models/tokenizers.py): Gemma's specials at their ids (`<pad>` 0,
`<eos>` 1, `<bos>` 2, `<unk>` 3), byte fallback, every id below T5Gemma's 256,000-token vocabulary. Its vocabulary is
small, so a prompt splits into more tokens than Gemma's makes; the compute does not change: SA3 pads every prompt to
256 tokens for the encoder and the DiT's cross-attention.
"""

from __future__ import annotations

from diffrl.models.realsize import Plan, merged, register_plan

# transformer/config.json: StableAudio3DiTModel's defaults, which its docstring gives as the SA3 model's (io_channels
# 256 = SAME's latent_dim, embed_dim 1536, 24 blocks of 24 heads, 768-wide text and duration conditions, 64 memory
# tokens, differential attention).
SA3_MEDIUM_TRANSFORMER = dict(
    io_channels=256,
    patch_size=1,
    embed_dim=1536,
    depth=24,
    num_heads=24,
    cond_token_dim=768,
    global_cond_dim=768,
    local_add_cond_dim=257,
    timestep_features_dim=256,
    ff_mult=4.0,
    num_memory_tokens=64,
    use_differential_attention=True,
)
# vae/config.json: SAME-L, "used by SA3 Medium" (AutoencoderSAME's docstring): encoder_channels 256, one resampling
# block of 12 transformer layers with stride 16 after 256-sample patches (4096 samples a latent frame), the last 8
# decoder layers with sine gating; stereo at 44.1 kHz (its sampling_rate default).
SAME_L_VAE = dict(
    audio_channels=2,
    patch_size=256,
    encoder_channels=256,
    encoder_c_mults=[6],
    encoder_strides=[16],
    encoder_transformer_depths=[12],
    latent_dim=256,
    use_differential_attention=True,
    dim_heads=64,
    ff_mult=3,
    sliding_window=1,
    encoder_sinusoidal_blocks=[0],
    decoder_sinusoidal_blocks=[8],
    sampling_rate=44100,
)
# text_encoder/config.json: google/t5gemma-b-b-ul2's encoder (T5Gemma "B": Gemma 2 layers of width 768, 12 layers of
# 12 heads of 64, MLP 2048, vocab 256000). Its published parameter count, 591,490,560 (keras-hub's t5gemma_b_b_ul2
# preset), is this encoder's 281,580,288 plus a decoder of the same width with cross-attention and its own embedding.
T5GEMMA_B_ENCODER = dict(
    vocab_size=256000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    query_pre_attn_scalar=64,
    hidden_activation="gelu_pytorch_tanh",
    sliding_window=4096,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    attention_dropout=0.0,
)
# duration_embedder/config.json: StableAudio3DurationEmbedder's defaults (768 wide, durations up to 384 s, "the
# production SA3 Medium upper bound").
SA3_DURATION_EMBEDDER = dict(output_dim=768, fourier_dim=256, min_val=0.0, max_val=384.0)
# scheduler/scheduler_config.json: the DiT takes timesteps in [0, 1] (num_train_timesteps 1, no shift; the pipeline
# builds its log-SNR sigmas itself); the distilled checkpoint samples with stochastic_sampling=True (8 ping-pong
# steps, the pipeline docstring), which diffrl replaces by Euler/SDE steps on the same sigmas.
SA3_SCHEDULER = dict(num_train_timesteps=1, shift=1.0, stochastic_sampling=True)
TEXT_TOKENS = 256  # SA3's tokenizer length (the pipeline's cap)


@register_plan("stable_audio3_medium")
def stable_audio3_medium_plan(scale: dict[str, dict] | None = None) -> Plan:
    """StableAudio3Pipeline at Stable Audio 3 Medium size (or scaled by `scale`), random weights."""
    from diffusers import AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DiTModel, StableAudio3Pipeline
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder
    from transformers import T5GemmaConfig, T5GemmaEncoderModel

    from diffrl.models.tokenizers import gemma_tokenizer

    scale = scale or {}
    tokenizer = gemma_tokenizer(model_max_length=TEXT_TOKENS)
    transformer = merged(SA3_MEDIUM_TRANSFORMER, scale.get("transformer"))
    vae = merged(SAME_L_VAE, scale.get("vae"))
    text = merged(T5GEMMA_B_ENCODER, scale.get("text_encoder"))
    duration = merged(SA3_DURATION_EMBEDDER, scale.get("duration_embedder"))
    _check_sa3(transformer, vae, text, duration, tokenizer)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    ids["bos_token_id"] = tokenizer.bos_token_id
    t5gemma = T5GemmaConfig(encoder={**text, **ids}, decoder={**text, **ids}, is_encoder_decoder=False, **ids)
    return Plan(
        pipeline_class=StableAudio3Pipeline,
        models={
            "transformer": lambda: StableAudio3DiTModel(**transformer),
            "vae": lambda: AutoencoderSAME(**vae),
            "text_encoder": lambda: T5GemmaEncoderModel(t5gemma),
            "duration_embedder": lambda: StableAudio3DurationEmbedder(**duration),
        },
        small={"tokenizer": tokenizer, "scheduler": FlowMatchEulerDiscreteScheduler(**SA3_SCHEDULER)},
    )


def _check_sa3(transformer: dict, vae: dict, text: dict, duration: dict, tokenizer) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    if transformer["cond_token_dim"] != text["hidden_size"]:
        raise ValueError(
            f"transformer.cond_token_dim={transformer['cond_token_dim']} must equal "
            f"text_encoder.hidden_size={text['hidden_size']}"
        )
    if not transformer["cond_token_dim"] == transformer["global_cond_dim"] == duration["output_dim"]:
        raise ValueError("transformer.cond_token_dim, global_cond_dim and duration_embedder.output_dim must agree")
    if transformer["io_channels"] != vae["latent_dim"]:
        raise ValueError("transformer.io_channels must equal vae.latent_dim")
    assert len(tokenizer) <= text["vocab_size"], "in-memory tokenizer larger than the text encoder's vocabulary"
