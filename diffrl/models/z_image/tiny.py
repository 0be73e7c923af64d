"""Tiny offline Z-Image pipeline (random weights, in-memory Qwen tokenizer).

Z-Image reads prompts with Qwen3's byte-level BPE tokenizer and chat template, built by
diffrl/models/tokenizers.py from the shared built-in corpus, so nothing is downloaded.

Sizes are chosen so that a 64x64, 4-step sample with CFG runs well under a second on a laptop CPU,
while keeping the real layouts: VAE factor 8, patch size 2, Z-Image's static shift 3.0 scheduler.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer


@register_tiny("z_image")
def build_z_image(out_dir: str, seed: int) -> None:
    """Tiny ZImagePipeline: 2+1+1-layer single-stream transformer, 4-level AutoencoderKL, tiny Qwen3."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = _z_image_pipeline()
    pipe.save_pretrained(out_dir, safe_serialization=True)


def _z_image_pipeline() -> ZImagePipeline:
    latent_channels, text_dim = 4, 32
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=latent_channels,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=text_dim,
        axes_dims=[8, 4, 4],
        axes_lens=[1024, 64, 64],
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    tokenizer = qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text_dim,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
