"""Config-only Qwen3-VL judge folders: config.json, an offline tokenizer with Qwen3-VL's specials and a chat template,
the image and video processor configs, no weights. vLLM serves such a folder with `--load-format dummy` (random
weights of the real shapes), which is what a judge-throughput benchmark needs (benchmarks/vllm_judge.py): compute does
not depend on weight values, and 17.5 GB of bf16 weights need not exist on disk.

Sizes:
    8b    Qwen/Qwen3-VL-8B-Instruct's published config.json: text 36 layers, hidden 4096, 32 query / 8 key-value heads
          of 128, MLP 12288, vocabulary 151936, untied head, interleaved M-RoPE (sections 24, 20, 20; theta 5e6;
          262144 positions); vision 27 blocks of 1152 (16 heads, MLP 4304), patch 16, temporal patch 2, spatial merge
          2, 2304 position embeddings, DeepStack at blocks 8, 16, 24, projecting to 4096. 8,767,123,696 parameters
          (tests/models/test_qwen3_vl_config.py counts them on the meta device: the model card's 8.77 B).
    tiny  the same layout cut to 2 text layers of 256 (2 heads of 128: vLLM's CPU attention supports head size 128)
          and 2 vision blocks of 64: a CPU check that vLLM builds, processes and serves the folder.
Deviations from the Hub folder: the special tokens' ids come from the offline tokenizer (a few hundred tokens, far
below the vocabulary; config.json names those ids), and the chat template is Qwen3-VL's reduced to user/assistant
turns of text and images (no tools, no video timestamps). The processor files carry the published values.

    python -m diffrl.models.causal_lm.realsize_qwen3_vl OUT_DIR [--size 8b]
"""

from __future__ import annotations

import argparse
import json
import os

SIZES = ("8b", "tiny")
PARAMETERS_8B = 8_767_123_696  # Qwen3VLForConditionalGeneration on the meta device (transformers 5.23)
VL_SPECIALS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# Qwen3-VL's template for user/assistant turns: string content, or OpenAI-style parts where each image part becomes
# <|vision_start|><|image_pad|><|vision_end|> (vLLM's multimodal processor expands <|image_pad|> to the image's tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ('video', 'video_url') %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json and video_preprocessor_config.json (pixel budgets included).
_PROCESSOR_COMMON = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
}
IMAGE_PROCESSOR = {
    **_PROCESSOR_COMMON,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PROCESSOR = {
    **_PROCESSOR_COMMON,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def text_config(size: str) -> dict:
    """The language model's keys as the Hub's config.json writes them (rope_scaling + rope_theta: the names
    transformers 5.x converts to rope_parameters and vLLM 0.24 reads)."""
    shape = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)
    shape.update(num_key_value_heads=8)
    if size == "tiny":
        shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2)
        shape.update(num_key_value_heads=1)
    return {
        "model_type": "qwen3_vl_text",
        **shape,
        "head_dim": 128,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "use_cache": True,
        "dtype": "bfloat16",
    }


def vision_config(size: str) -> dict:
    """The vision tower's keys as the Hub's config.json writes them (model_type qwen3_vl, which transformers maps)."""
    shape = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, deepstack_visual_indexes=[8, 16, 24])
    if size == "tiny":
        shape = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, deepstack_visual_indexes=[0])
    return {
        "model_type": "qwen3_vl",
        **shape,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "out_hidden_size": 256 if size == "tiny" else 4096,
        "initializer_range": 0.02,
    }


def model_config(token_ids: dict[str, int], size: str = "8b") -> dict:
    """config.json of a Qwen3-VL judge (`size` in SIZES); `token_ids`: the tokenizer's ids of VL_SPECIALS' tokens."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}; got {size!r}")
    text = text_config(size)
    text.update(bos_token_id=token_ids["pad"], eos_token_id=token_ids["eos"])
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": vision_config(size),
        "image_token_id": token_ids["image_token"],
        "video_token_id": token_ids["video_token"],
        "vision_start_token_id": token_ids["vision_start_token"],
        "vision_end_token_id": token_ids["vision_end_token"],
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def judge_tokenizer():
    """Qwen2-style byte-level BPE built in memory (diffrl/models/tokenizers.py) with Qwen3-VL's specials as named
    tokens (the attributes Qwen3VLProcessor reads) and CHAT_TEMPLATE."""
    from diffrl.models.tokenizers import qwen_tokenizer

    return qwen_tokenizer(chat_template=CHAT_TEMPLATE, named_specials=VL_SPECIALS)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def write_config_folder(out_dir: str, *, size: str = "8b") -> str:
    """A Qwen3-VL folder without weights (vLLM: `--load-format dummy`): config.json, generation_config.json, the
    offline tokenizer with its chat template (chat_template.jinja), preprocessor_config.json and
    video_preprocessor_config.json. Returns out_dir."""
    tokenizer = judge_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VL_SPECIALS.items()}
    ids.update(pad=tokenizer.pad_token_id, eos=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config = model_config(ids, size)  # validates size before anything is written
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation = {"bos_token_id": ids["pad"], "eos_token_id": [ids["eos"], ids["pad"]], "pad_token_id": ids["pad"]}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    tokenizer.save_pretrained(out_dir)
    _write_json(os.path.join(out_dir, "preprocessor_config.json"), IMAGE_PROCESSOR)
    _write_json(os.path.join(out_dir, "video_preprocessor_config.json"), VIDEO_PROCESSOR)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a config-only Qwen3-VL judge folder (vLLM --load-format dummy)")
    parser.add_argument("out_dir")
    parser.add_argument("--size", default="8b", choices=SIZES)
    args = parser.parse_args(argv)
    print(write_config_folder(args.out_dir, size=args.size))


if __name__ == "__main__":
    main()
