"""Tiny offline LLaVA judge: transformers' ``LlavaForConditionalGeneration`` at tiny size (a 2-layer CLIP vision tower,
a 2-layer Llama language model), a Qwen byte-level BPE tokenizer built in memory with ``<image>`` as a named special,
the PIL CLIP image processor and a ``LlavaProcessor`` config, saved as a Hugging Face folder (safetensors) that vLLM
serves as an OpenAI-compatible chat judge (diffrl serve-judge) with no network.

The weights are random except the language model's head: every row is zero but two, the tokens "3" and "4", which
read one hidden feature with opposite signs. Greedy decoding then answers "3" or "4" (a rating the ``vlm_judge``
reward parses as 0.5 or 0.75), which one depending on the image and the question through the whole network: a judge
that always answers in the rating format yet still looks at the image. Head dims are 32 (vLLM's CPU attention
supports 32, 64, 80, ... only).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.clip import CLIPImageProcessorPil

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import qwen_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 8  # 16 image tokens per image
RATING_TOKENS = ("3", "4")  # the only two tokens the head can emit
# A chat template for string or OpenAI-style list content: each image part becomes <image>, text parts are joined.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message['role'].upper() + ': ' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- else %}{{- '<image>\\n' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)


def tiny_llava_config(vocab_size: int, image_token_id: int, pad_token_id: int, eos_token_id: int) -> LlavaConfig:
    """A 2+2-layer LLaVA-1.5 layout: CLIP vision tower (penultimate layer, CLS dropped), 2-layer MLP projector."""
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=pad_token_id,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


@register_tiny("llava_judge")
def build_llava_judge(out_dir: str, seed: int) -> None:
    """Tiny LLaVA judge folder (random weights but a rating head, offline tokenizer, processor files)."""
    tokenizer = qwen_tokenizer(chat_template=CHAT_TEMPLATE, named_specials={"image_token": IMAGE_TOKEN})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rating_ids = [tokenizer.convert_tokens_to_ids(t) for t in RATING_TOKENS]
    if any(i == tokenizer.unk_token_id or i is None for i in rating_ids):
        raise AssertionError(f"the tiny tokenizer has no single tokens {RATING_TOKENS}")
    config = tiny_llava_config(len(tokenizer), image_token_id, tokenizer.pad_token_id, eos)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # the rating head: "3" if hidden feature 0 is positive, else "4"
        head = model.lm_head.weight
        head.zero_()
        head[rating_ids[0], 0], head[rating_ids[1], 0] = 1.0, -1.0
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir, safe_serialization=True)
    _hub_vision_names(os.path.join(out_dir, "model.safetensors"))
    pixels = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=pixels)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)


def _hub_vision_names(path: str) -> None:
    """Name the vision tower's weights as the llava-hf checkpoints on the Hub do (``vision_tower.vision_model.*``):
    transformers 5.23 writes ``vision_tower.*``, which vLLM's CLIP loader does not find, while both load the Hub's."""
    state = load_file(path)
    renamed = {
        (f"vision_tower.vision_model.{k[len('vision_tower.') :]}" if k.startswith("vision_tower.") else k): v
        for k, v in state.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})
