"""Tiny offline Qwen-Image-Edit pipeline: Qwen-Image's tiny transformer, VAE and scheduler
(diffrl/models/qwen_image/tiny.py) with a tiny Qwen2.5-VL whose vision tower is used: the tokenizer has Qwen's vision
specials (`<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`) as real tokens the model config points at, and a
`Qwen2VLProcessor` (the PIL Qwen2-VL image processor, no torchvision) turns the input image into 4 merged patches (56x56
pixels, patch 14, merge 2), so the instruction's encoding depends on the image, as in Qwen-Image-Edit.

Upstream's edit template (`QwenImageEditPipeline.prompt_template_encode`) is trained into the BPE vocabulary
(repeated), so its words are single tokens as with Qwen's own vocabulary; the pipeline drops a fixed 64 tokens.
"""

from __future__ import annotations

import json
import os

import torch
from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from diffrl.models.qwen_image.adapter_edit import ImageOnlyQwen2VLProcessor
from diffrl.models.qwen_image.tiny import _scheduler_qwen_image
from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

VISION_SPECIALS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# The words of QwenImageEditPipeline's system prompt and of the shapes editing instructions.
_EDIT_TEXT = (
    "system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new image that "
    "meets the user's requirements while maintaining consistency with the original input where appropriate.\n"
    "user\nassistant\nmake the red circle blue green yellow purple square triangle keep everything else\n"
)
_VISION_PIXELS = 56 * 56  # the image processor's fixed input size: a 4x4 patch grid, 2x2 merged tokens


@register_tiny("qwen_image_edit")
def build_qwen_image_edit(out_dir: str, seed: int) -> None:
    """Tiny QwenImageEditPipeline: 2-block transformer, 3-level Qwen VAE (factor 8), tiny Qwen2.5-VL with vision."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = qwen_image_edit_pipeline()
    pipe.save_pretrained(out_dir, safe_serialization=True)
    # Name the processor as the released Qwen/Qwen-Image-Edit folder does (the adapter builds it image-only).
    index_path = os.path.join(out_dir, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def qwen_image_edit_pipeline() -> QwenImageEditPipeline:
    """The tiny pipeline in memory (weights from torch's global RNG)."""
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
    tokenizer = qwen_tokenizer(vocab_size=700, extra_texts=[_EDIT_TEXT] * 20, named_specials=VISION_SPECIALS)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in VISION_SPECIALS.items()}
    text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(len(tokenizer), text_dim, ids)).eval()
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=_VISION_PIXELS, max_pixels=_VISION_PIXELS
    )
    return QwenImageEditPipeline(
        scheduler=_scheduler_qwen_image(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer),
        transformer=transformer,
    )


def _text_encoder_config(vocab_size: int, text_dim: int, ids: dict[str, int]) -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
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
            # at the default 0.02 a random 1-block tower maps every image to nearly the same tokens
            "initializer_range": 0.2,
        },
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
    )
