"""Config-only Qwen3-Omni Thinker folders: config.json, an offline tokenizer, the image processor and the audio feature
extractor, no weights. A run whose `model.path` is `random:<folder>` builds the model from the config with random
weights, in memory on its device (diffrl/flows/build_tokens.py): the real-size 30B-A3B Thinker would not fit the GPU
machine's disk as a weights folder (~61 GB in bf16 of a 64 GB disk), and a benchmark of rollout and update speed
needs no trained weights.

Sizes:
    30b-a3b  the Qwen3-Omni-30B-A3B Thinker's text model: 48 layers, hidden 2048, 32 query / 4 key-value heads of 128,
             128 experts of 768 (8 active per token), vocabulary 152064, M-RoPE sections (24, 20, 20) interleaved;
             the vision and audio towers at transformers' Qwen3OmniMoe defaults (vision: 27 blocks of 1152, deepstack
             at 8, 16, 24; audio: 32 layers of 1280), projecting to 2048. `layers` cuts the text model for a smaller
             GPU.
    30b-a3b-text  the same text model alone, as a Qwen3-MoE causal LM (`Qwen3MoeForCausalLM`: plain RoPE, which
             M-RoPE is on text-only positions): what a vLLM server builds with `load_format: dummy` and the trainer
             with random weights (diffrl/configs/thinker_text_gspo_vllm.yaml, benchmarks/vllm_ar.py).
    tiny     diffrl/models/causal_lm/tiny_thinker.py's tiny Thinker (the CPU smoke run).
Token ids of the specials come from the offline tokenizer (few hundred tokens), far below the vocabulary.

    python -m diffrl.models.causal_lm.realsize OUT_DIR [--size 30b-a3b-text] [--layers 48]
"""

from __future__ import annotations

import argparse
import json
import os

from transformers import Qwen3MoeConfig, Qwen3OmniMoeThinkerConfig

from diffrl.models.causal_lm.tiny_thinker import OMNI_SPECIALS, save_preprocessors, tiny_thinker, tiny_thinker_config

SIZES = ("30b-a3b", "30b-a3b-text", "tiny")


def thinker_30b_a3b_config(token_ids: dict[str, int], *, layers: int = 48) -> Qwen3OmniMoeThinkerConfig:
    """The 30B-A3B Thinker's config (module docstring), with `layers` text decoder layers."""
    hidden = 2048
    return Qwen3OmniMoeThinkerConfig(
        text_config={
            "vocab_size": 152064,
            "hidden_size": hidden,
            "intermediate_size": 768,
            "moe_intermediate_size": 768,
            "num_hidden_layers": layers,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 65536,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [24, 20, 20],
                "interleaved": True,
                "mrope_interleaved": True,
            },
        },
        vision_config={"out_hidden_size": hidden},
        audio_config={"output_dim": hidden},
        image_token_id=token_ids["image_token"],
        audio_token_id=token_ids["audio_token"],
        video_token_id=token_ids["video_token"],
        vision_start_token_id=token_ids["vision_bos_token"],
        audio_start_token_id=token_ids["audio_bos_token"],
    )


def thinker_text_config(tokenizer, *, layers: int = 48) -> Qwen3MoeConfig:
    """The 30B-A3B Thinker's text model alone as a Qwen3-MoE causal LM (thinker_30b_a3b_config's text_config)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return Qwen3MoeConfig(
        vocab_size=152064,
        hidden_size=2048,
        intermediate_size=768,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        architectures=["Qwen3MoeForCausalLM"],
        dtype="bfloat16",
    )


def write_config_folder(out_dir: str, *, size: str = "30b-a3b", layers: int = 48) -> str:
    """A Thinker folder without weights (`random:<out_dir>` builds it): config.json, generation_config.json, the
    offline tokenizer, the image processor and the audio feature extractor (30b-a3b-text: config and tokenizer)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}; got {size!r}")
    os.makedirs(out_dir, exist_ok=True)
    if size == "30b-a3b-text":
        return _write_text_folder(out_dir, layers)
    model, tokenizer, processor = tiny_thinker(0)  # the tokenizer and processor; the tiny weights are not kept
    token_ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in OMNI_SPECIALS.items()}
    if size == "tiny":
        config = tiny_thinker_config(len(tokenizer), token_ids)
    else:
        config = thinker_30b_a3b_config(token_ids, layers=layers)
    config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        json.dump({"eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}, f)
    tokenizer.save_pretrained(out_dir)
    save_preprocessors(out_dir, processor, config.audio_config.num_mel_bins)  # image processor and audio extractor
    return out_dir


def _write_text_folder(out_dir: str, layers: int) -> str:
    from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    tokenizer = qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)
    config = thinker_text_config(tokenizer, layers=layers)
    config.save_pretrained(out_dir)
    # the names older transformers releases (the GPU machine's 5.17, vLLM's venv) and vLLM's model file read too
    with open(os.path.join(out_dir, "config.json")) as f:
        data = json.load(f)
    data.update(num_experts=config.num_experts, rope_theta=1000000.0)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(data, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": config.eos_token_id, "pad_token_id": tokenizer.pad_token_id}, f)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="write a config-only Qwen3-Omni Thinker folder (model.path: random:)")
    parser.add_argument("out_dir")
    parser.add_argument("--size", default="30b-a3b", choices=SIZES)
    parser.add_argument("--layers", type=int, default=48, help="text decoder layers (30b-a3b sizes)")
    args = parser.parse_args(argv)
    print(write_config_folder(args.out_dir, size=args.size, layers=args.layers))


if __name__ == "__main__":
    main()
