"""A configs-only HunyuanImage-3.0 folder at the released size (`model.path: random:<folder>` builds it with random
weights in memory) and its parameter count on the meta device, for GPU planning without the ~170 GB checkpoint.

config.json carries the released shape (tencent/HunyuanImage-3.0's config.json as third-party readers of it quote
it: e.g. NVIDIA NeMo-Automodel's and lightx2v's HunyuanImage-3 configs; the field defaults of the reference
`configuration_hunyuan.py`): 32 layers, hidden 4096, 32 query / 8 key-value heads of 128, 64 routed experts of width
3072 with top-8 routing and one shared expert per layer, vocabulary 133120, RoPE base 10000; the image head's
`patch_embed_hidden_dim` 1024 and `image_base_size` 1024; the VAE [128, 256, 512, 1024, 1024], 32 latent channels,
16x spatial / 4x temporal, scaling factor 0.562679178327931. The tokenizer is the offline BPE of the tiny model with
HunyuanImage-3.0's added tokens (the real 133k-token vocabulary is not available offline): prompts split into more
tokens than the real tokenizer would make, the ids stay inside the vocabulary.

`parameter_counts()` (meta device, no memory): the text-to-image transformer as built here (no lm_head, ln_f, ViT,
VAE encoder), the same plus lm_head (the checkpoint's language model), the active parameters per token (attention,
router, shared expert, moe_topk of 64 experts, embeddings and lm_head; and without the two embedding tables),
and the VAE decoder. Released config: 80.75 B built, 81.30 B with lm_head, 13.65 B active per token (12.56 B
without the embeddings; the release says 80 B total, 13 B active), VAE decoder 0.87 B.
"""

from __future__ import annotations

import json
import os

import torch

from diffrl.models.hunyuan_image3 import layout
from diffrl.models.hunyuan_image3.config import HunyuanImage3Config
from diffrl.models.hunyuan_image3.model import HunyuanImage3Transformer
from diffrl.models.hunyuan_image3.vae import HunyuanImage3VAE

LAYERS = 32
RELEASED = {
    "architectures": ["HunyuanImage3ForCausalMM"],
    "model_type": "hunyuan_image_3_moe",
    "vocab_size": 133120,
    "hidden_size": 4096,
    "intermediate_size": 3072,
    "moe_intermediate_size": [3072] * LAYERS,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attention_head_dim": 128,
    "num_experts": 64,
    "moe_topk": [8] * LAYERS,
    "num_shared_expert": [1] * LAYERS,
    "use_mixed_mlp_moe": True,
    "moe_drop_tokens": False,
    "moe_layer_num_skipped": 0,
    "norm_topk_prob": True,
    "use_qk_norm": True,
    "use_rotary_pos_emb": True,
    "rope_scaling": {"type": "custom", "factor": 1.0},
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 22800,
    "attention_bias": False,
    "mlp_bias": False,
    "img_proj_type": "unet",
    "patch_size": 1,
    "patch_embed_hidden_dim": 1024,
    "vae_downsample_factor": [16, 16],
    "image_base_size": 1024,
    "bos_token_id": 127958,
    "eos_token_id": 127957,
    "pad_token_id": 128009,
    "image_token_id": 128006,
    "vae": {
        "block_out_channels": [128, 256, 512, 1024, 1024],
        "downsample_match_channel": True,
        "ffactor_spatial": 16,
        "ffactor_temporal": 4,
        "in_channels": 3,
        "latent_channels": 32,
        "layers_per_block": 2,
        "out_channels": 3,
        "sample_size": 384,
        "sample_tsize": 96,
        "scaling_factor": 0.562679178327931,
        "shift_factor": None,
        "upsample_match_channel": True,
    },
    "torch_dtype": "bfloat16",
}


def write_config_folder(out_dir: str, *, size: str = "80b", layers: int | None = None) -> str:
    """Write config.json, generation_config.json and tokenizer.json (no weights) into out_dir; size "80b" or
    "tiny" (the tiny folder's configs); layers cuts the decoder (a smaller GPU probe)."""
    from diffrl.models.hunyuan_image3.tiny import BASE_SIZE, added_tokens, tiny_config
    from diffrl.models.tokenizers import qwen_tokenizer

    if size not in ("80b", "tiny"):
        raise ValueError(f"size must be '80b' or 'tiny'; got {size!r}")
    tokenizer = qwen_tokenizer()
    tokenizer.add_tokens(added_tokens(RELEASED["image_base_size"] if size == "80b" else BASE_SIZE), special_tokens=True)
    if size == "80b":  # the offline tokenizer's <bos> stands in for the real one's id 127958
        raw = dict(RELEASED, bos_token_id=tokenizer.convert_tokens_to_ids("<|startoftext|>"))
    else:
        raw = tiny_config(tokenizer)
    if layers is not None:
        raw = _cut(raw, int(layers))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, layout.CONFIG), "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(out_dir, layout.GENERATION_CONFIG), "w") as f:
        json.dump(dict(layout.GENERATION_DEFAULTS, sequence_template="pretrain", bot_task="image"), f, indent=2)
    tokenizer.backend_tokenizer.save(os.path.join(out_dir, layout.TOKENIZER))
    return out_dir


def _cut(raw: dict, layers: int) -> dict:
    out = dict(raw, num_hidden_layers=layers)
    for key in ("moe_intermediate_size", "moe_topk", "num_shared_expert", "num_experts"):
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    return out


def parameter_counts(raw: dict | None = None) -> dict[str, int]:
    """Parameter counts of a config.json dict (default: the released one), built on the meta device."""
    config = HunyuanImage3Config.from_dict(dict(raw or RELEASED))
    with torch.device("meta"):
        transformer = HunyuanImage3Transformer(layout.config_dict(config))
        vae = HunyuanImage3VAE(config.vae)
    built = sum(p.numel() for p in transformer.parameters())
    lm_head = config.vocab_size * config.hidden_size
    expert = sum(p.numel() for p in transformer.layers[0].mlp.experts[0].parameters())
    inactive = sum(
        (config.per_layer("num_experts", i) - config.per_layer("moe_topk", i)) * expert
        for i in range(config.num_hidden_layers)
    )
    return {
        "transformer": built,
        "total": built + lm_head,
        "active": built + lm_head - inactive,
        "active_without_embeddings": built - inactive - config.vocab_size * config.hidden_size,
        "vae_decoder": sum(p.numel() for p in vae.parameters()),
    }
