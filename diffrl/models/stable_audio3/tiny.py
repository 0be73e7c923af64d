"""A tiny Stable Audio 3 pipeline (`diffrl tiny-model stable_audio3`): every component of `StableAudio3Pipeline` at
toy size with random weights, saved as an ordinary diffusers folder that loads offline.

Stereo at 8 kHz; the SAME autoencoder packs 8-sample patches and halves them once more (16 samples a latent frame,
8 latent channels); a 2-block StableAudio3DiTModel with differential attention and 4 memory tokens; a 2-layer
T5Gemma encoder behind diffrl's in-memory Gemma tokenizer (32 tokens a prompt, as SA3 pads to its tokenizer's
length). The scheduler is `FlowMatchEulerDiscreteScheduler(num_train_timesteps=1)` as SA3's, with
`stochastic_sampling=False`: the upstream pipeline then runs the Euler ODE, which diffrl's sampler reproduces at
noise level 0 (the distilled checkpoint ships `stochastic_sampling=True`, its ping-pong re-noising sampler; see
adapter.py).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DiTModel, StableAudio3Pipeline
from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder
from transformers import T5GemmaConfig, T5GemmaEncoderModel

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import gemma_tokenizer

_TEXT_DIM, _LATENT_DIM, _WIDTH = 32, 8, 32
SAMPLE_RATE = 8000
_TEXT_OUTPUT_GAIN = 20.0  # random T5Gemma outputs are small: let the prompt visibly change the audio
_OUTPUT_GAIN = 4.0  # the DiT's zero-initialised output conv left as is, but its projection scaled up
_VAE_TOKEN_STD = 0.1  # the decoder's output tokens (1e-5 at init): audio at about -25 dBFS instead of silence


def text_encoder_config(vocab_size: int) -> T5GemmaConfig:
    """An encoder-only T5Gemma at toy size (2 layers, one sliding-window and one full-attention layer, as Gemma 2
    alternates them)."""
    encoder = dict(
        vocab_size=vocab_size,
        hidden_size=_TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        max_position_embeddings=256,
        attention_dropout=0.0,
    )
    return T5GemmaConfig(encoder=encoder, decoder=encoder, is_encoder_decoder=False, vocab_size=vocab_size)


def _wake_vae(vae: AutoencoderSAME) -> None:
    """SAME zero-initialises every attention and feed-forward output projection and starts its resampling tokens at
    1e-5: at random init the decoder would ignore the latents and return near silence. Random (1 / sqrt(fan_in))
    output projections and larger tokens make the waveform depend on the latents at an audible level."""
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if name.endswith(("attn.to_out.weight", "ff.proj_out.weight")):
                param.normal_(std=param.shape[1] ** -0.5)
            elif name.endswith("new_tokens"):
                param.normal_(std=_VAE_TOKEN_STD)


@register_tiny("stable_audio3")
def build_stable_audio3(out_dir: str, seed: int) -> None:
    """Tiny StableAudio3Pipeline (stereo, 8 kHz, 16 samples a latent frame)."""
    torch.manual_seed(seed)
    tokenizer = gemma_tokenizer(model_max_length=32)
    text_encoder = T5GemmaEncoderModel(text_encoder_config(len(tokenizer))).eval()
    with torch.no_grad():
        text_encoder.encoder.norm.weight.add_(_TEXT_OUTPUT_GAIN)  # Gemma's RMSNorm scales by (1 + weight)
    vae = AutoencoderSAME(
        audio_channels=2,
        patch_size=8,
        encoder_channels=8,
        encoder_c_mults=(2,),
        encoder_strides=(2,),
        encoder_transformer_depths=(1,),
        latent_dim=_LATENT_DIM,
        dim_heads=8,
        ff_mult=2,
        sliding_window=1,
        sampling_rate=SAMPLE_RATE,
    )
    _wake_vae(vae)
    transformer = StableAudio3DiTModel(
        io_channels=_LATENT_DIM,
        embed_dim=_WIDTH,
        depth=2,
        num_heads=2,
        cond_token_dim=_TEXT_DIM,
        global_cond_dim=_TEXT_DIM,
        local_add_cond_dim=_LATENT_DIM + 1,
        timestep_features_dim=16,
        ff_mult=2.0,
        num_memory_tokens=4,
    )
    with torch.no_grad():
        transformer.proj_out.weight.mul_(_OUTPUT_GAIN)
    pipe = StableAudio3Pipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        duration_embedder=StableAudio3DurationEmbedder(output_dim=_TEXT_DIM, fourier_dim=16),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0, stochastic_sampling=False),
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
