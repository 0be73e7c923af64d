"""Qwen-Image-2.1 at real size with random weights (`diffrl random-model qwen_image21`): the configs of
Qwen/Qwen-Image-2.1 (each with its source) and the plan diffrl/models/realsize.py writes.

- transformer: QwenImage21Transformer2DModel's defaults in diffusers 0.42.1 (its docstring: the 2.1 checkpoint's
  single-stream model; 32 blocks of 32 heads x 128, text projected from 4096, MLP ratio 3, 64 latent channels,
  unpatched), 7.115 B parameters on the meta device; public summaries of the release (github.com/wildminder/
  awesome-qwen-image) say "7B parameters in the visual generation component, 32 single-stream DiT layers".
- vae: AutoencoderKLQwenImage21's defaults (z_dim 64, 16x compression, RGBA, the published latents_mean/std), 0.338 B.
- text_encoder: Qwen3-VL-8B-Instruct with its vision tower, the numbers of diffrl/models/causal_lm/realsize_qwen3_vl.py
  (Qwen/Qwen3-VL-8B-Instruct's config.json); the pipeline's docs name Qwen3-VL and its `context_in_dim` 4096 is that
  model's width. 8.767 B.
- scheduler: Qwen-Image's (diffrl/models/qwen_image/realsize.py); Qwen-Image-2.1's scheduler_config.json and its
  `sample_sigmas` were not found published, so the folder ships none and sigmas are linspace(1, 1/N, N) shifted.
- processor: an offline Qwen byte-level BPE (Qwen-Image's prompt tokenizer recipe) with Qwen's vision specials and
  Qwen3-VL's chat template, and Qwen3-VL-8B's image processor settings (16-pixel patches, merge 2).
32.4 GB in bf16 (16.22 B values); `--configs-only` and `model.path: random:<folder>` skip writing them.
"""

from __future__ import annotations

from diffrl.models.causal_lm.realsize_qwen3_vl import IMAGE_PROCESSOR, text_config, vision_config
from diffrl.models.realsize import Plan, merged, register_plan

# QwenImage21Transformer2DModel's defaults, written out.
QWEN_IMAGE21_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=32,
    attention_head_dim=128,
    num_attention_heads=32,
    context_in_dim=4096,
    mlp_ratio=3,
    axes_dims_rope=(16, 56, 56),
    causal_condition=True,
)
QWEN_IMAGE21_VAE: dict = {}  # AutoencoderKLQwenImage21's defaults
_HUB_ONLY = ("model_type", "dtype", "use_cache")  # keys of the Hub's config.json that the config classes set themselves


def qwen3_vl_8b(token_ids: dict[str, int]) -> dict:
    """Qwen3VLConfig kwargs of Qwen3-VL-8B-Instruct; `token_ids`: our tokenizer's ids of the specials."""
    text = {k: v for k, v in text_config("8b").items() if k not in _HUB_ONLY}
    text.update(bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"])
    vision = {k: v for k, v in vision_config("8b").items() if k not in _HUB_ONLY}
    return dict(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **{f"{name}_id": token_ids[name] for name in ("image_token", "video_token")},
        **{f"{name}_id": token_ids[name] for name in ("vision_start_token", "vision_end_token")},
    )


@register_plan("qwen_image21")
def qwen_image21_plan(scale: dict[str, dict] | None = None) -> Plan:
    """QwenImage21Pipeline at Qwen-Image-2.1 size (or scaled by `scale`), random weights."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from diffrl.models.qwen_image.realsize import QWEN_IMAGE_SCHEDULER, qwen_prompt_tokenizer
    from diffrl.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE, TEMPLATE_TEXT, VISION_SPECIALS, processor
    from diffrl.models.tokenizers import ENDOFTEXT, IM_END

    scale = scale or {}
    tokenizer = qwen_prompt_tokenizer(
        chat_template=QWEN3_VL_CHAT_TEMPLATE, extra_texts=[TEMPLATE_TEXT] * 20, named_specials=VISION_SPECIALS
    )
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_SPECIALS.items()}
    ids.update(bos=tokenizer.convert_tokens_to_ids(ENDOFTEXT), eos=tokenizer.convert_tokens_to_ids(IM_END))
    ids.update(pad=tokenizer.pad_token_id)  # Qwen's: <|endoftext|>, <|im_end|>, <|endoftext|>
    transformer = merged(QWEN_IMAGE21_TRANSFORMER, scale.get("transformer"))
    vae = merged(QWEN_IMAGE21_VAE, scale.get("vae"))
    text = merged(qwen3_vl_8b(ids), scale.get("text_encoder"))
    _check(transformer, vae, text, tokenizer)
    return Plan(
        pipeline_class=QwenImage21Pipeline,
        models={
            "transformer": lambda: QwenImage21Transformer2DModel(**transformer),
            "vae": lambda: AutoencoderKLQwenImage21(**vae),
            "text_encoder": lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(**text)),
        },
        small={
            "processor": processor(tokenizer, patch_size=IMAGE_PROCESSOR["patch_size"]),
            "scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        },
        config={"sample_sigmas": None},
    )


def _check(transformer: dict, vae: dict, text: dict, tokenizer) -> None:
    z_dim = vae.get("z_dim", 64)  # AutoencoderKLQwenImage21's default
    if transformer["context_in_dim"] != text["text_config"]["hidden_size"]:
        raise ValueError("transformer.context_in_dim must equal text_encoder.text_config.hidden_size")
    if transformer["in_channels"] != z_dim or transformer["out_channels"] != z_dim:
        raise ValueError(f"transformer in/out channels must equal the VAE's z_dim={z_dim} (latents are unpatched)")
    assert len(tokenizer) <= text["text_config"]["vocab_size"], "tokenizer larger than the text vocabulary"
