"""FLUX.2 at real size with random weights (`diffrl random-model flux2_klein` for klein base 9B, `flux2_klein_4b` for
klein base 4B, `flux2_dev` for the 32B dev): the published configs (each with its source) and the plans
diffrl/models/realsize.py writes.

The transformer sizes are those of black-forest-labs/FLUX.2-klein-base-9B and -4B transformer/config.json (double /
single blocks 8 / 24 and 5 / 20, 32 and 24 heads of 128, joint_attention_dim 12288 and 7680 = 3 x the text encoder's
width: the pipeline stacks hidden layers 9, 18 and 27), as public ports of the model list them; every other field is
the diffusers default of `Flux2Transformer2DModel` (in_channels 128, mlp_ratio 3, 4-axis RoPE of 32, theta 2000,
timestep_guidance_channels 256), with `guidance_embeds` off (klein base runs true CFG). The text encoders are
Qwen/Qwen3-8B and Qwen/Qwen3-4B (config.json). The VAE is `AutoencoderKLFlux2` at its diffusers defaults (32 latent
channels, 4 levels of 128-512, a batch norm over the 128 patchified channels). The tokenizer is the Qwen byte-level
BPE trained in memory on the prompt generators' text (diffrl/models/qwen_image/realsize.py) with Qwen3's chat
template.

FLUX.2-dev (black-forest-labs/FLUX.2-dev): the transformer at the diffusers defaults of `Flux2Transformer2DModel`,
which are FLUX.2-dev's (8 double / 48 single blocks, 48 heads of 128, joint_attention_dim 15360 = 3 x 5120, guidance
embedding on), and a `Mistral3ForConditionalGeneration` at transformers' `Mistral3Config` defaults, which are
mistralai/Mistral-Small-3.1-24B-Instruct-2503's (40 layers of 5120, the Pixtral vision tower; FLUX.2-dev ships
Mistral-Small-3.2-24B, the same shape). Its hidden layers 10, 20 and 30 are stacked. One deviation: the real folder's
`tokenizer` is a `PixtralProcessor` (which needs torchvision); this folder holds a text tokenizer with a Mistral-style
chat template instead, which is all a text prompt goes through.
"""

from __future__ import annotations

import copy
import functools

from diffrl.models.flux2.tiny import FLUX2_SCHEDULER
from diffrl.models.qwen_image.realsize import qwen_prompt_tokenizer
from diffrl.models.realsize import Plan, merged, register_plan

# black-forest-labs/FLUX.2-klein-base-9B transformer/config.json (the fields that differ from the diffusers defaults).
KLEIN_9B_TRANSFORMER = dict(
    num_layers=8,
    num_single_layers=24,
    attention_head_dim=128,
    num_attention_heads=32,
    joint_attention_dim=12288,
    guidance_embeds=False,
)
# black-forest-labs/FLUX.2-klein-base-4B transformer/config.json.
KLEIN_4B_TRANSFORMER = dict(KLEIN_9B_TRANSFORMER, num_layers=5, num_single_layers=20, num_attention_heads=24)
KLEIN_4B_TRANSFORMER["joint_attention_dim"] = 7680
# Qwen/Qwen3-8B config.json: 36 layers of 4096, MLP 12288, 32 query / 8 key-value heads of 128, untied embeddings.
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000,
    tie_word_embeddings=False,
)
# Qwen/Qwen3-4B config.json: 36 layers of 2560, MLP 9728, tied embeddings.
QWEN3_4B = dict(QWEN3_8B, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
# The stacked hidden layers `Flux2KleinPipeline.encode_prompt` reads by default (`Flux2Pipeline`: 10, 20, 30).
TEXT_LAYERS_READ = (9, 18, 27)
DEV_TEXT_LAYERS_READ = (10, 20, 30)
# FLUX.2-dev's system prompt and the user turn in Mistral's instruction format; the content lists of
# `format_input` (one text part each) are joined.
MISTRAL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set text = message['content'] if message['content'] is string else "
    "(message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text }}{%- endif %}"
    "{%- endfor %}"
)


@register_plan("flux2_klein")
def flux2_klein_plan(scale: dict[str, dict] | None = None) -> Plan:
    """Flux2KleinPipeline at FLUX.2-klein-base-9B size (or scaled by `scale`), random weights."""
    return _klein_plan(KLEIN_9B_TRANSFORMER, QWEN3_8B, scale)


@register_plan("flux2_klein_4b")
def flux2_klein_4b_plan(scale: dict[str, dict] | None = None) -> Plan:
    """Flux2KleinPipeline at FLUX.2-klein-base-4B size (or scaled by `scale`), random weights."""
    return _klein_plan(KLEIN_4B_TRANSFORMER, QWEN3_4B, scale)


@register_plan("flux2_dev")
def flux2_dev_plan(scale: dict[str, dict] | None = None) -> Plan:
    """Flux2Pipeline at FLUX.2-dev size (or scaled by `scale`), random weights."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers import Flux2Transformer2DModel as Transformer
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    scale = scale or {}
    tokenizer = copy.deepcopy(_klein_tokenizer())
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    transformer = merged({"guidance_embeds": True}, scale.get("transformer"))
    vae = merged({}, scale.get("vae"))
    # untied output head, as Mistral-Small-3.1's config.json (transformers' Mistral3Config ties it by default)
    text = merged(dict(Mistral3Config().to_dict(), tie_word_embeddings=False), scale.get("text_encoder"))
    width, layers = text["text_config"]["hidden_size"], text["text_config"]["num_hidden_layers"]
    joint = merged({"joint_attention_dim": 15360}, transformer)["joint_attention_dim"]
    _check_widths(joint, width, layers, len(tokenizer), text["text_config"]["vocab_size"], DEV_TEXT_LAYERS_READ)
    text["text_config"] = dict(text["text_config"], pad_token_id=tokenizer.pad_token_id)
    return Plan(
        pipeline_class=Flux2Pipeline,
        models={
            "transformer": lambda: Transformer(**transformer),
            "vae": lambda: AutoencoderKLFlux2(**vae),
            "text_encoder": lambda: Mistral3ForConditionalGeneration(Mistral3Config(**text)),
        },
        small={"tokenizer": tokenizer, "scheduler": FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)},
    )


def _klein_plan(transformer_config: dict, text_config: dict, scale: dict[str, dict] | None) -> Plan:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from diffusers import Flux2Transformer2DModel as Transformer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from diffrl.models.tokenizers import ENDOFTEXT, IM_END

    scale = scale or {}
    tokenizer = copy.deepcopy(_klein_tokenizer())
    transformer = merged(transformer_config, scale.get("transformer"))
    vae = merged({}, scale.get("vae"))
    text = merged(text_config, scale.get("text_encoder"))
    _check_widths(
        transformer["joint_attention_dim"],
        text["hidden_size"],
        text["num_hidden_layers"],
        len(tokenizer),
        text["vocab_size"],
        TEXT_LAYERS_READ,
    )
    ids = dict(
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
    )
    return Plan(
        pipeline_class=Flux2KleinPipeline,
        models={
            "transformer": lambda: Transformer(**transformer),
            "vae": lambda: AutoencoderKLFlux2(**vae),
            "text_encoder": lambda: Qwen3ForCausalLM(Qwen3Config(**text, **ids)),
        },
        small={"tokenizer": tokenizer, "scheduler": FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)},
        config={"is_distilled": False},
    )


@functools.lru_cache(maxsize=1)
def _klein_tokenizer():
    """The prompt-trained Qwen tokenizer with Qwen3's chat template, trained once per process (seconds of BPE)."""
    from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE

    tokenizer = qwen_prompt_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def _check_widths(joint: int, width: int, layers: int, tokens: int, vocab: int, read: tuple[int, ...]) -> None:
    """The widths the pipeline joins must agree (they do at real size; `scale` must keep them so)."""
    if joint != len(read) * width:
        raise ValueError(
            f"transformer.joint_attention_dim={joint} must be {len(read)} x the text encoder's hidden size {width} "
            f"(hidden layers {read} stacked)"
        )
    if layers < max(read):
        raise ValueError(f"the text encoder needs >= {max(read)} layers (the layers read), got {layers}")
    assert tokens <= vocab, "tokenizer larger than the text vocabulary"
