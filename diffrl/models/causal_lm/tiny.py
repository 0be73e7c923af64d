"""Tiny offline Qwen3 causal LM: transformers' ``Qwen3ForCausalLM`` at tiny size (2 layers, hidden 64, head_dim 32:
vLLM's CPU attention supports head sizes 32, 64, 80, ... only), random weights, the Qwen byte-level BPE tokenizer
built in memory with Qwen3's chat template. A Hugging Face folder (safetensors) that both CausalLMPolicy and a vLLM
server load offline: what the vLLM rollout engine's tests serve (diffrl/engines/rollout/vllm_tokens.py).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer


def tiny_qwen3_config(tokenizer) -> Qwen3Config:
    """The tiny Qwen3's config for `tokenizer` (the Qwen byte-level BPE one); responses end with <|im_end|>."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
    )


@register_tiny("qwen3")
def build_qwen3(out_dir: str, seed: int) -> None:
    """Tiny Qwen3ForCausalLM folder; responses end with <|im_end|> (the generation config's EOS)."""
    tokenizer = qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)
    config = tiny_qwen3_config(tokenizer)
    eos = config.eos_token_id
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
