"""A configs-only BAGEL folder at the real BAGEL-7B-MoT size (`model.path: random:<folder>` builds it with random
weights in memory), for GPU benchmarks without the 29 GB checkpoint.

llm_config.json carries Qwen2.5-7B-Instruct's shape, as BAGEL-7B-MoT's does (28 layers, hidden 3584, MLP 18944, 28
query / 4 key-value heads, vocabulary 152064, RoPE theta 1e6; vLLM's BAGEL config.json quotes the same llm_config),
with BAGEL's qk_norm / layer_module entries; vit_config.json SigLIP so400m's (not built: no ViT for text-to-image).
The VAE is the FLUX one of BAGEL's load_ae and max_latent_size 64 (layout.py). The tokenizer is the offline Qwen2
BPE of diffrl/models/tokenizers.py (the real 151k-token vocabulary is not available offline): prompts split into more
tokens than Qwen's own tokenizer would make, the ids stay inside the vocabulary. Parameters built (meta-device count):
13.61 B, of which 6.53 B in the generation expert (lm_head and the ViT are not built); the FLUX VAE 0.084 B.
"""

from __future__ import annotations

import json
import os

from diffrl.models.bagel.layout import LLM_CONFIG, VIT_CONFIG

BAGEL_7B_LLM = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "qk_norm": True,
    "layer_module": "Qwen2MoTDecoderLayer",
    "torch_dtype": "bfloat16",
}
SIGLIP_SO400M = {
    "model_type": "siglip_vision_model",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "image_size": 980,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


def write_config_folder(out_dir: str, *, size: str = "7b-mot", layers: int | None = None) -> str:
    """Write llm_config.json, vit_config.json and the tokenizer (no weights) into out_dir; size "7b-mot" or "tiny"
    (the tiny folder's configs); layers cuts the decoder (a smaller GPU probe)."""
    from diffrl.models.bagel.tiny import tiny_llm_config
    from diffrl.models.tokenizers import qwen_tokenizer

    if size not in ("7b-mot", "tiny"):
        raise ValueError(f"size must be '7b-mot' or 'tiny'; got {size!r}")
    tokenizer = qwen_tokenizer(
        named_specials={"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
    )
    llm = dict(BAGEL_7B_LLM) if size == "7b-mot" else tiny_llm_config(len(tokenizer))
    if layers is not None:
        llm["num_hidden_layers"] = int(layers)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, LLM_CONFIG), "w") as f:
        json.dump(llm, f, indent=2)
    with open(os.path.join(out_dir, VIT_CONFIG), "w") as f:
        json.dump(SIGLIP_SO400M, f, indent=2)
    tokenizer.save_pretrained(out_dir)
    return out_dir
