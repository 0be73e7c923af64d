"""Tiny offline Qwen3-Omni Thinker: transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` at tiny size (a
2-layer Qwen3-MoE text model with 4 experts, a 2-block vision encoder with one deepstack layer, a 1-layer audio
encoder), random weights, a Qwen byte-level BPE tokenizer built in memory with the Omni specials as named tokens, the
PIL Qwen2-VL image processor and Qwen3-Omni's WhisperFeatureExtractor settings (diffrl/models/causal_lm/audio.py). Saved
as a Hugging Face folder (safetensors) that diffrl.models.causal_lm.policy loads; preprocessor_config.json holds the
image processor's and the feature extractor's keys in one file, as Qwen3-Omni's folders do.

Deviation from the real folder: no video processor is saved (transformers' video processor needs torchvision, which
the CPU machines lack), so ``Qwen3OmniMoeProcessor`` is not used; the adapter expands image and audio placeholders
itself as that processor does.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch
from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from diffrl.models.causal_lm.audio import feature_extractor
from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

# The Omni multimodal specials, by the attribute names Qwen3OmniMoeProcessor reads from its tokenizer.
OMNI_SPECIALS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# ChatML as Qwen's templates write a text turn: the adapter renders multimodal turns itself (causal_lm.py).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
IMAGE_SIZE = 64  # pixels a side the tiny image processor resizes to: (64 / 16)^2 / 2^2 = 4 image tokens


def tiny_thinker_config(
    vocab_size: int, token_ids: dict[str, int], *, hidden_size: int = 32, head_dim: int = 16
) -> Qwen3OmniMoeThinkerConfig:
    """The tiny Thinker's config: the real layout (MoE text model with interleaved M-RoPE, deepstack vision, audio
    encoder) at a size that generates tens of tokens per second on one CPU core. head_dim 32 is the smallest that vLLM's
    CPU attention takes (the vLLM rollout tests; 16 by default)."""
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (M-RoPE sections 2:3:3 of its pairs); got {head_dim}")
    scale = head_dim // 16
    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "moe_intermediate_size": hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 4096,
            # Qwen3-Omni's M-RoPE: head_dim / 2 frequency pairs split (t, h, w) = (2, 3, 3) x head_dim / 16,
            # interleaved
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [2 * scale, 3 * scale, 3 * scale],
                "interleaved": True,
                "mrope_interleaved": True,
            },
            "pad_token_id": 0,
            "bos_token_id": 0,
            "eos_token_id": 2,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": hidden_size,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1],
        },
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": hidden_size,
            "downsample_hidden_size": 8,
            # at the default 0.02 the tower's three stride-2 convolutions shrink the mel input far below the
            # sinusoidal position embedding added after them: two different clips came out 5e-7 apart, so a random
            # tiny tower heard no difference between them; at 0.2 they are ~0.5 apart (tests/models/test_causal_lm.py)
            "initializer_range": 0.2,
        },
        image_token_id=token_ids["image_token"],
        audio_token_id=token_ids["audio_token"],
        video_token_id=token_ids["video_token"],
        vision_start_token_id=token_ids["vision_bos_token"],
        audio_start_token_id=token_ids["audio_bos_token"],
    )


def tiny_thinker(seed: int, *, extra_texts: Sequence[str] = (), hidden_size: int = 32, head_dim: int = 16):
    """(model, tokenizer, image processor) of a tiny Thinker, in memory; `extra_texts` (a task's prompts and
    answers) become single BPE tokens."""
    tokenizer = qwen_tokenizer(chat_template=CHAT_TEMPLATE, extra_texts=extra_texts, named_specials=OMNI_SPECIALS)
    token_ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in OMNI_SPECIALS.items()}
    config = tiny_thinker_config(len(tokenizer), token_ids, hidden_size=hidden_size, head_dim=head_dim)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pixels = IMAGE_SIZE * IMAGE_SIZE
    processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=pixels, max_pixels=pixels
    )
    return model, tokenizer, processor


def save_preprocessors(out_dir: str, processor, num_mel_bins: int) -> None:
    """preprocessor_config.json: the image processor's keys and the audio feature extractor's (Qwen3-Omni's settings
    at the audio tower's num_mel_bins) in one file, as Qwen3-Omni's folders hold them."""
    processor.save_pretrained(out_dir)
    config = os.path.join(out_dir, "preprocessor_config.json")
    with open(config) as f:
        keys = json.load(f)
    audio = feature_extractor(num_mel_bins).to_dict()  # without its mel filters, derived from the other keys
    with open(config, "w") as f:
        json.dump({**keys, **audio}, f, indent=2, sort_keys=True)


def save_thinker_folder(out_dir: str, model, tokenizer, processor) -> str:
    """A Hugging Face folder of the Thinker (safetensors weights) that diffrl.models.causal_lm.policy loads."""
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    save_preprocessors(out_dir, processor, model.config.audio_config.num_mel_bins)
    return out_dir


def build_thinker_folder(
    out_dir: str, seed: int, *, extra_texts: Sequence[str] = (), hidden_size: int = 32, head_dim: int = 16
) -> None:
    """Write the tiny Thinker folder (random weights)."""
    save_thinker_folder(
        out_dir, *tiny_thinker(seed, extra_texts=extra_texts, hidden_size=hidden_size, head_dim=head_dim)
    )


@register_tiny("qwen3_omni")
def build_qwen3_omni(out_dir: str, seed: int) -> None:
    """Tiny Qwen3-Omni Thinker folder (transformers classes, random weights, offline tokenizer)."""
    build_thinker_folder(out_dir, seed)
