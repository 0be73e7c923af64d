"""Tiny offline Qwen-Image and Z-Image pipelines (random weights, in-memory Qwen tokenizer).

Both architectures read prompts with a Qwen byte-level BPE tokenizer: Qwen-Image with Qwen2.5-VL
(`Qwen2Tokenizer`, `<|im_start|>`/`<|im_end|>`/`<|endoftext|>` specials), Z-Image with Qwen3 (same
tokenizer family plus a chat template). `qwen_tokenizer` builds that tokenizer with the `tokenizers`
library from the shared built-in corpus, so nothing is downloaded.

Sizes are chosen so that a 64x64, 4-step sample with CFG runs well under a second on a laptop CPU,
while keeping the real layouts: VAE factor 8, patch size 2, Qwen-Image's mrope text encoder and
dynamic-shift scheduler (with `shift_terminal`), Z-Image's static shift 3.0 scheduler.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3Model,
)

from diffrl.models.tiny import register_tiny
from diffrl.models.tiny.tokenizers import CORPUS

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's pre-tokenisation regex (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's chat template reduced to what text-only prompts use: the user turn, the generation prompt,
# and the empty <think> block Qwen3 inserts only when enable_thinking=False (Z-Image passes True).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# The chat-template words (Qwen-Image's system prompt, the roles), repeated so that BPE learns each as
# one token, as in Qwen's real vocabulary: Qwen-Image's prefix is then exactly the 34 tokens its
# pipeline drops (`prompt_template_encode_start_idx`), like with the real tokenizer.
_TEMPLATE_TEXT = (
    "system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:\nuser\nassistant\n"
)
_TEMPLATE_REPEATS = 20


def qwen_tokenizer(
    *,
    vocab_size: int = 600,
    chat_template: str | None = None,
    extra_texts: Sequence[str] = (),
    named_specials: Mapping[str, str] | None = None,
) -> Qwen2Tokenizer:
    """A Qwen2-style byte-level BPE tokenizer trained in memory on the shared corpus (after `extra_texts`, e.g.
    the prompts a run will see, so their words become single tokens).

    Specials: `<|endoftext|>` (id 0; also pad/eos/unk as in Qwen's tokenizers), `<|im_start|>`,
    `<|im_end|>`. Deterministic: fixed corpus, deterministic trainer. Pass `chat_template` (e.g.
    QWEN3_CHAT_TEMPLATE) for pipelines that call `apply_chat_template`. `named_specials` adds more specials after
    those, each also an attribute of the tokenizer (e.g. {"image_token": "<|image_pad|>"}, as multimodal processors
    read them).
    """
    named_specials = dict(named_specials or {})
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END, *named_specials.values()],
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
        show_progress=False,
    )
    tok.train_from_iterator([*extra_texts, *CORPUS, *[_TEMPLATE_TEXT] * _TEMPLATE_REPEATS], trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    qwen = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=131072,
        extra_special_tokens=[IM_START, IM_END, *named_specials.values()],
        **named_specials,
    )
    if chat_template is not None:
        qwen.chat_template = chat_template
    return qwen


def _scheduler_qwen_image() -> FlowMatchEulerDiscreteScheduler:
    # Qwen/Qwen-Image's scheduler_config.json: exponential dynamic shift, stretched to end at 0.02.
    return FlowMatchEulerDiscreteScheduler(
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


@register_tiny("qwen_image")
def build_qwen_image(out_dir: str, seed: int) -> None:
    """Tiny QwenImagePipeline: 2-block transformer, 3-level Qwen VAE (factor 8), tiny Qwen2.5-VL."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = _qwen_image_pipeline()
    pipe.save_pretrained(out_dir, safe_serialization=True)


def _qwen_image_pipeline() -> QwenImagePipeline:
    z_dim, text_dim = 4, 32
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_dim,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    tokenizer = qwen_tokenizer()
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": text_dim,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": text_dim,
            "fullatt_block_indexes": [0],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        # Vision placeholders point past the tiny vocabulary: text-only prompts never contain them.
        image_token_id=len(tokenizer) + 1,
        video_token_id=len(tokenizer) + 2,
        vision_start_token_id=len(tokenizer) + 3,
        vision_end_token_id=len(tokenizer) + 4,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return QwenImagePipeline(
        scheduler=_scheduler_qwen_image(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


@register_tiny("z_image")
def build_z_image(out_dir: str, seed: int) -> None:
    """Tiny ZImagePipeline: 2+1+1-layer single-stream transformer, 4-level AutoencoderKL, tiny Qwen3."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        pipe = _z_image_pipeline()
    pipe.save_pretrained(out_dir, safe_serialization=True)


def _z_image_pipeline() -> ZImagePipeline:
    latent_channels, text_dim = 4, 32
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=latent_channels,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=text_dim,
        axes_dims=[8, 4, 4],
        axes_lens=[1024, 64, 64],
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    tokenizer = qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text_dim,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
