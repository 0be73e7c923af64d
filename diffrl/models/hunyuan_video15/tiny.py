"""Tiny offline HunyuanVideo-1.5 text-to-video pipeline ("hunyuan_video15").

The real layout at toy size: a Qwen2.5-VL text model read through its chat template (the in-memory Qwen BPE of
diffrl/models/tokenizers.py, trained with the pipeline's system message so that the template's prefix is exactly
the 108 tokens the pipeline crops, as with Qwen2.5-VL's own tokenizer), the glyph encoder (transformers'
`ByT5Tokenizer`, which needs no vocabulary file, and a small T5 encoder), a 5-level AutoencoderKLHunyuanVideo15
(spatial factor 16, temporal factor 4), a 2-block HunyuanVideo15Transformer3DModel, a FlowMatchEuler scheduler with
the 480p T2V shift 5.0 and ClassifierFreeGuidance at its 6.0.

The transformer's glyph projection has a fixed 2048-wide hidden layer in diffusers (`HunyuanVideo15ByT5TextProjection`),
so the folder holds ~17 MB of weights however small the widths around it.
"""

from __future__ import annotations

import inspect

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from transformers import (
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
)

from diffrl.models.tiny import register_tiny
from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

_Z_DIM, _TEXT_DIM, _GLYPH_DIM = 4, 32, 32
# The BPE size at which the template's prefix (system turn + "<|im_start|>user\n") is 108 tokens.
_QWEN_VOCAB_SIZE = 1000
# At random init the prompt barely moves the tiny model's video (CFG on or off: 2.5 of 255 in mean); sharper
# video-to-text attention (larger video-query and text-key RMSNorm gains) and a louder glyph projection let the
# prompt, its quoted text and so CFG visibly change it (7.2, and 2.9 for another quoted text), so parity tests can
# tell guidance and the glyph encoder apart from none.
_TEXT_ATTENTION_GAIN = 3.0
_GLYPH_PROJECTION_GAIN = 8.0


def system_message() -> str:
    """The system turn HunyuanVideo15Pipeline puts before every prompt (its `_get_mllm_prompt_embeds` default)."""
    signature = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return signature.parameters["system_message"].default


def hunyuan_video15_tokenizer() -> Qwen2Tokenizer:
    """The in-memory Qwen BPE with Qwen2.5-VL's rendering of a system + user turn (QWEN3_CHAT_TEMPLATE gives the same
    text for them), right-padding as the converted folders' tokenizer; the template's prefix is 108 tokens."""
    tokenizer = qwen_tokenizer(
        vocab_size=_QWEN_VOCAB_SIZE, chat_template=QWEN3_CHAT_TEMPLATE, extra_texts=[system_message()]
    )
    tokenizer.padding_side = "right"
    return tokenizer


def _text_encoder(vocab_size: int) -> Qwen2_5_VLTextModel:
    """A 3-layer Qwen2.5-VL text model: the pipeline reads the third hidden state from the end (layer 1's output)."""
    config = Qwen2_5_VLTextConfig(
        vocab_size=vocab_size,
        hidden_size=_TEXT_DIM,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
    )
    return Qwen2_5_VLTextModel(config).eval()


def _glyph_encoder(vocab_size: int) -> T5EncoderModel:
    """A 2-layer T5 encoder over ByT5's byte vocabulary (the real one is Glyph-SDXL-v2's byT5-small)."""
    config = T5Config(
        vocab_size=vocab_size,
        d_model=_GLYPH_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


def _transformer() -> HunyuanVideo15Transformer3DModel:
    """2 dual-stream blocks, 1 refiner block; in_channels = noisy latents + condition latents + 1 mask channel."""
    model = HunyuanVideo15Transformer3DModel(
        in_channels=2 * _Z_DIM + 1,
        out_channels=_Z_DIM,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=_TEXT_DIM,
        text_embed_2_dim=_GLYPH_DIM,
        image_embed_dim=16,
        rope_axes_dim=(4, 6, 6),
        target_size=64,
        task_type="t2v",
    )
    with torch.no_grad():
        for block in model.transformer_blocks:
            block.attn.norm_q.weight.mul_(_TEXT_ATTENTION_GAIN)
            block.attn.norm_added_k.weight.mul_(_TEXT_ATTENTION_GAIN)
        model.context_embedder_2.linear_3.weight.mul_(_GLYPH_PROJECTION_GAIN)
    return model


@register_tiny("hunyuan_video15")
def build_hunyuan_video15(out_dir: str, seed: int) -> None:
    """Tiny HunyuanVideo15Pipeline (480p T2V layout): shift 5.0, guidance 6.0."""
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        tokenizer = hunyuan_video15_tokenizer()
        tokenizer_2 = ByT5Tokenizer()
        pipe = HunyuanVideo15Pipeline(
            text_encoder=_text_encoder(len(tokenizer)),
            tokenizer=tokenizer,
            transformer=_transformer(),
            vae=AutoencoderKLHunyuanVideo15(
                latent_channels=_Z_DIM,
                block_out_channels=(8, 8, 8, 8, 8),
                layers_per_block=1,
                spatial_compression_ratio=16,
                temporal_compression_ratio=4,
                scaling_factor=1.03682,
            ),
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0),
            text_encoder_2=_glyph_encoder(len(tokenizer_2)),
            tokenizer_2=tokenizer_2,
            guider=ClassifierFreeGuidance(guidance_scale=6.0),
        )
    pipe.save_pretrained(out_dir, safe_serialization=True)
