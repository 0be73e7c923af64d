"""Tiny offline Qwen-Image pipeline (random weights, in-memory Qwen tokenizer).

Qwen-Image reads prompts with a Qwen byte-level BPE tokenizer (Qwen2.5-VL's `Qwen2Tokenizer`, `<|im_start|>` /
`<|im_end|>` / `<|endoftext|>` specials), built by diffrl/models/tokenizers.py from the shared built-in corpus, so
nothing is downloaded.

Sizes are chosen so that a 64x64, 4-step sample with CFG runs well under a second on a laptop CPU,
while keeping the real layouts: VAE factor 8, patch size 2, Qwen-Image's mrope text encoder and
dynamic-shift scheduler (with `shift_terminal`).
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer


def _scheduler_qwen_image() -> FlowMatchEulerDiscreteScheduler:
    # Qwen/Qwen-Image's scheduler_config.json: exponential dynamic shift, stretched to end at 0.02.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


@register_tiny("qwen_image")
def build_qwen_image(out_dir: str, seed: int) -> None:
    """Tiny QwenImagePipeline: 2-block transformer, 3-level Qwen VAE (factor 8), tiny Qwen2.5-VL."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = _qwen_image_pipeline()
    pipe.save_pretrained(out_dir, safe_serialization=True)


def _qwen_image_pipeline() -> QwenImagePipeline:
    z_dim, text_dim = 4, 32
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_dim,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    tokenizer = qwen_tokenizer()
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_dim,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": text_dim,
            "fullatt_block_indexes": [0],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        # Vision placeholders point past the tiny vocabulary: text-only prompts never contain them.
        image_token_id=len(tokenizer) + 1,
        video_token_id=len(tokenizer) + 2,
        vision_start_token_id=len(tokenizer) + 3,
        vision_end_token_id=len(tokenizer) + 4,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return QwenImagePipeline(
        scheduler=_scheduler_qwen_image(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
