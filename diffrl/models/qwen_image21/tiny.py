"""Tiny offline Qwen-Image-2.1 pipeline (random weights, in-memory Qwen tokenizer).

The layout of Qwen/Qwen-Image-2.1 at toy width: a 2-block single-stream QwenImage21Transformer2DModel taking
unpatched 8-channel latents, a 5-level AutoencoderKLQwenImage21 (16x compression, RGBA out), a 2-layer Qwen3-VL, and a
`processor/` (Qwen3VLProcessor's files without its video processor) whose tokenizer is a Qwen byte-level BPE built by
diffrl/models/tokenizers.py with Qwen's vision specials and a Qwen3-VL-style chat template (the pipeline counts the
system tokens it drops by rendering the system message with it). Nothing is downloaded; a 64x64, 4-step sample runs
in well under a second on a CPU.
"""

from __future__ import annotations

import json
import os

import torch
from diffusers import (
    AutoencoderKLQwenImage21,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from diffrl.models.qwen_image.tiny import _scheduler_qwen_image
from diffrl.models.qwen_image21.adapter import ImageOnlyQwen3VLProcessor
from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

VISION_SPECIALS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# Qwen3-VL's chat template for text messages: a string content, or a list of {"type": "text"} parts joined.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# QwenImage21Pipeline's system prompt and roles, learnt as whole words as Qwen's vocabulary has them.
TEMPLATE_TEXT = "system\nComprehend and analyze the provided prompt.\nuser\nassistant\n"
_VISION_PIXELS = 64 * 64


def qwen3_vl_tokenizer(vocab_size: int = 700, extra_texts: tuple[str, ...] = ()):
    """A Qwen2 byte-level BPE with Qwen's vision specials and QWEN3_VL_CHAT_TEMPLATE."""
    return qwen_tokenizer(
        vocab_size=vocab_size,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
        extra_texts=[*extra_texts, *[TEMPLATE_TEXT] * 20],
        named_specials=VISION_SPECIALS,
    )


def processor(tokenizer, *, patch_size: int = 16) -> ImageOnlyQwen3VLProcessor:
    """The pipeline's processor: the tokenizer and a PIL Qwen2-VL image processor (Qwen3-VL's 16-pixel patches)."""
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=2, temporal_patch_size=2, min_pixels=_VISION_PIXELS, max_pixels=_VISION_PIXELS
    )
    return ImageOnlyQwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def save_pipeline(pipe: QwenImage21Pipeline, out_dir: str) -> None:
    """save_pretrained, the processor named as the released folder names it (the adapter builds it image-only)."""
    pipe.save_pretrained(out_dir, safe_serialization=True)
    pipe.processor.tokenizer.save_pretrained(os.path.join(out_dir, "processor"))  # with its chat template
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


@register_tiny("qwen_image21")
def build_qwen_image21(out_dir: str, seed: int) -> None:
    """Tiny QwenImage21Pipeline: 2-block transformer, 5-level RGBA VAE (factor 16), tiny Qwen3-VL."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = qwen_image21_pipeline()
    save_pipeline(pipe, out_dir)


def qwen_image21_pipeline() -> QwenImage21Pipeline:
    """The tiny pipeline in memory (weights from torch's global RNG)."""
    z_dim, text_dim = 8, 32
    transformer = QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=z_dim,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=text_dim,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 2, 2, 2],  # four downsamples: the 16x compression the pipeline assumes
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3, 0.0, -0.1, 0.2, 0.15],
        latents_std=[1.5, 0.8, 1.2, 2.0, 1.0, 0.9, 1.1, 1.3],
    )
    tokenizer = qwen3_vl_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in VISION_SPECIALS.items()}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_dim,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": text_dim,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
    )
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    return QwenImage21Pipeline(
        scheduler=_scheduler_qwen_image(),  # Qwen-Image's dynamic shift, read the same way by 2.1
        vae=vae,
        text_encoder=text_encoder,
        processor=processor(tokenizer),
        transformer=transformer,
    )
