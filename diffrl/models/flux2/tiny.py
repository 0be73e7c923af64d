"""Tiny Flux2KleinPipeline (arch "flux2"): FLUX.2-klein's layout at toy size, random weights.

Kept from the real model: a Qwen3 causal LM read at hidden layers 9, 18 and 27 (the pipeline's default
`text_encoder_out_layers`, so the tiny LM has 28 layers, each 16 wide) with Qwen3's chat template, an
AutoencoderKLFlux2 with scale factor 8, 2x2 patchify and a batch norm over the patchified channels (its running
stats set to random values so decoding un-normalises for real), double- and single-stream blocks with 4-axis RoPE,
no guidance embedding (klein base: true CFG against the empty prompt), and the dynamically shifted flow-matching
scheduler. A 64x64 image is 4x4 = 16 image tokens; prompts are padded to 512 text tokens as upstream.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

TEXT_DIM, TEXT_LAYERS, LATENT_CHANNELS = 16, 28, 4
# FLUX.2's scheduler/scheduler_config.json (klein and dev; the tiny and real-size pipelines both use it): the pipeline
# passes mu (compute_empirical_mu), so the shift is dynamic.
FLUX2_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    base_shift=0.5,
    max_shift=1.15,
)


@register_tiny("flux2")
def build_flux2(out_dir: str, seed: int) -> None:
    """Build the tiny FLUX.2-klein pipeline (seeded random weights) and save it to out_dir."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = tiny_flux2_pipeline()
    pipe.save_pretrained(out_dir, safe_serialization=True)


def tiny_vae() -> AutoencoderKLFlux2:
    """A 4-level AutoencoderKLFlux2 (scale factor 8) with random batch-norm running stats."""
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=64,
    )
    vae.bn.running_mean.copy_(0.1 * torch.randn_like(vae.bn.running_mean))
    vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    return vae.eval()


def tiny_flux2_pipeline() -> Flux2KleinPipeline:
    tokenizer = qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=1024,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).eval()
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_DIM,  # three hidden layers stacked per token
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=tiny_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )
