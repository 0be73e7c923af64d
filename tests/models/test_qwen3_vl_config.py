"""The config-only Qwen3-VL-8B judge folder (diffrl/models/causal_lm/realsize_qwen3_vl.py) that benchmarks/vllm_judge.py
serves with vLLM's dummy weights: transformers reads it as the published architecture (parameters counted on the meta
device against the model card's 8.77 B), and its tokenizer renders image turns with Qwen3-VL's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, Qwen3VLForConditionalGeneration

from diffrl.models.causal_lm.realsize_qwen3_vl import PARAMETERS_8B, VL_SPECIALS, write_config_folder


@pytest.fixture(scope="module")
def folder_8b(tmp_path_factory) -> str:
    return write_config_folder(str(tmp_path_factory.mktemp("qwen3_vl") / "judge"), size="8b")


def _parameters(config) -> int:
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def test_8b_config_is_the_published_architecture(folder_8b):
    config = AutoConfig.from_pretrained(folder_8b)
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size, text.vocab_size) == (
        4096,
        36,
        12288,
        151936,
    )
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (32, 8, 128)
    assert text.rope_parameters["mrope_section"] == [24, 20, 20] and text.rope_parameters["mrope_interleaved"]
    assert text.rope_parameters["rope_theta"] == 5000000
    assert (vision.depth, vision.hidden_size, vision.patch_size, vision.spatial_merge_size) == (27, 1152, 16, 2)
    assert list(vision.deepstack_visual_indexes) == [8, 16, 24] and vision.out_hidden_size == 4096
    assert not config.tie_word_embeddings
    count = _parameters(config)
    # the model card's "8.77B" (Qwen/Qwen3-VL-8B-Instruct); the exact count is what vLLM's dummy load allocates
    assert count == PARAMETERS_8B and round(count / 1e9, 2) == 8.77


def test_tokenizer_renders_an_image_turn_with_the_config_token_ids(folder_8b):
    tokenizer = AutoTokenizer.from_pretrained(folder_8b)
    with open(f"{folder_8b}/config.json") as f:
        config = json.load(f)
    for name, token in VL_SPECIALS.items():
        assert getattr(tokenizer, name) == token
        assert config[f"{name}_id"] == tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id
    messages = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "Rate it."}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Rate it.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids.count(config["image_token_id"]) == 1 and ids.count(config["vision_start_token_id"]) == 1


def test_unknown_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="size must be one of"):
        write_config_folder(str(tmp_path / "x"), size="32b")
    assert not (tmp_path / "x").exists()
