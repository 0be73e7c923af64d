"""Qwen-Image at real size with random weights (`diffrl random-model qwen_image`): the published configs of
Qwen/Qwen-Image (each with its source) and the plan diffrl/models/realsize.py writes.

The tokenizer is a Qwen byte-level BPE trained in memory on the prompt generators' text (`qwen_prompt_tokenizer`)
with the real special tokens; every token id stays below the real vocabulary size. Checked in bf16 on the CPU with
the modules' own init: Qwen2.5-VL's residual stream grows slowly (std 5.7 after 5 of its 28 layers, finite); the
Qwen-Image blocks (6 of 60 at real width) keep std ~0.58. ~57.7 GB in bf16: on a 64 GB disk write the configs only
and train with `model.path: random:<folder>`.
"""

from __future__ import annotations

from diffrl.models.realsize import Plan, merged, register_plan

# ---- Qwen/Qwen-Image ------------------------------------------------------------------------------
# transformer/config.json.
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
# vae/config.json equals AutoencoderKLQwenImage's defaults (base_dim 96, z_dim 16).
QWEN_IMAGE_VAE: dict = {}
# scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)
# text_encoder: Qwen2.5-VL-7B-Instruct, vision tower included. Qwen/Qwen-Image text_encoder/config.json
# (transformers 4.53.1), as reproduced in aigc-apps/VideoX-Fun comfyui/qwenimage/nodes.py; the same numbers
# as Qwen/Qwen2.5-VL-7B-Instruct config.json. Token ids of the tokenizer-dependent fields are ours (below).
QWEN25_VL_7B = dict(
    text_config=dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        hidden_act="silu",
        max_position_embeddings=128000,
        max_window_layers=28,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        attention_dropout=0.0,
        use_sliding_window=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]),
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        hidden_act="silu",
        in_channels=3,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
        initializer_range=0.02,
    ),
    # Vision placeholders keep their published ids: our ~1k-token vocabulary never produces them.
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    tie_word_embeddings=False,
)
# A cap: the prompt generators' text saturates Qwen's BPE at ~1.1k tokens, one token per common word.
QWEN_BPE_VOCAB_SIZE = 4096


@register_plan("qwen_image")
def qwen_image_plan(scale: dict[str, dict] | None = None) -> Plan:
    """QwenImagePipeline at Qwen-Image size (or scaled by `scale`), random weights."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffrl.models.tokenizers import ENDOFTEXT, IM_END

    scale = scale or {}
    tokenizer = qwen_prompt_tokenizer()
    transformer = merged(QWEN_IMAGE_TRANSFORMER, scale.get("transformer"))
    vae = merged(QWEN_IMAGE_VAE, scale.get("vae"))
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
    }  # Qwen's: <|endoftext|>, <|im_end|>
    text = merged(merged(QWEN25_VL_7B, {"text_config": ids}), scale.get("text_encoder"))
    _check_qwen_image(transformer, vae, text, tokenizer)
    return Plan(
        pipeline_class=QwenImagePipeline,
        models={
            "transformer": lambda: QwenImageTransformer2DModel(**transformer),
            "vae": lambda: AutoencoderKLQwenImage(**vae),
            "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**text)),
        },
        small={"tokenizer": tokenizer, "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)},
    )


def _check_qwen_image(transformer: dict, vae: dict, text: dict, tokenizer) -> None:
    z_dim = vae.get("z_dim", 16)  # AutoencoderKLQwenImage's default
    if transformer["joint_attention_dim"] != text["text_config"]["hidden_size"]:
        raise ValueError("transformer.joint_attention_dim must equal text_encoder.text_config.hidden_size")
    if transformer["in_channels"] != 4 * z_dim or transformer["out_channels"] != z_dim:
        raise ValueError(f"transformer in/out channels must be 4 * z_dim / z_dim with the VAE's z_dim={z_dim}")
    assert len(tokenizer) <= text["text_config"]["vocab_size"], "tokenizer larger than the text vocabulary"


def qwen_prompt_tokenizer(vocab_size: int = QWEN_BPE_VOCAB_SIZE, **options):
    """A Qwen2 byte-level BPE tokenizer with realistic token counts for the prompts diffrl trains on.

    diffrl/models/tokenizers.py's recipe (Qwen2's split regex, byte-level BPE, <|endoftext|> / <|im_start|> /
    <|im_end|> specials, Qwen-Image's template words learnt whole so the template prefix is exactly the 34
    tokens the pipeline drops), trained on 4,000 prompts from the OCR and GenEval-style generators plus the
    tiny corpus: their words become single tokens (~1 token per word, as with Qwen's 151k vocabulary). `options` go to
    `qwen_tokenizer` (its `extra_texts` come first).
    """
    from diffrl.engines.store.prompts import compositional_prompts, ocr_prompts
    from diffrl.models.tokenizers import qwen_tokenizer

    texts = [r.prompt for r in ocr_prompts(3000, seed=0)] + [r.prompt for r in compositional_prompts(1000, seed=0)]
    extra = list(options.pop("extra_texts", ()))
    return qwen_tokenizer(vocab_size=vocab_size, extra_texts=extra + texts, **options)
