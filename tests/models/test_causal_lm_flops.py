"""Active parameters (diffrl/models/causal_lm/flops.py) against hand counts of tiny configs and the 30B-A3B text
model's published ~3 B active."""

from __future__ import annotations

from transformers import Qwen3Config, Qwen3MoeConfig

from diffrl.models.causal_lm.flops import active_parameters
from diffrl.models.causal_lm.realsize import thinker_text_config
from diffrl.models.causal_lm.tiny_thinker import tiny_thinker_config
from diffrl.models.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

MOE = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=6,
    num_experts_per_tok=2,
)
ATTENTION = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q (4 x 8 heads), k and v (2 x 8), o
LM_HEAD = 100 * 32


def test_moe_counts_attention_the_router_the_top_k_experts_and_the_lm_head():
    expert = 3 * 32 * 16  # gate, up, down
    moe_layer = ATTENTION + 32 * 6 + 2 * expert  # router over 6 experts, 2 of them run
    assert active_parameters(Qwen3MoeConfig(**MOE)) == 3 * moe_layer + LM_HEAD


def test_mlp_only_and_sparse_step_layers_are_dense():
    dense_layer = ATTENTION + 3 * 32 * 64
    moe_layer = ATTENTION + 32 * 6 + 2 * 3 * 32 * 16
    # layer 0 dense (mlp_only_layers), layer 1 MoE ((1 + 1) % 2 == 0), layer 2 dense ((2 + 1) % 2 != 0)
    config = Qwen3MoeConfig(**MOE, mlp_only_layers=[0], decoder_sparse_step=2)
    assert active_parameters(config) == 2 * dense_layer + moe_layer + LM_HEAD


def test_dense_model_counts_every_matmul_weight_but_the_embedding():
    config = Qwen3Config(
        **{k: v for k, v in MOE.items() if k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok")}
    )
    assert active_parameters(config) == 3 * (ATTENTION + 3 * 32 * 64) + LM_HEAD


def test_thinker_counts_its_text_model_and_30b_a3b_is_3b_active():
    thinker = tiny_thinker_config(
        100, {k: 1 for k in ("image_token", "audio_token", "video_token", "vision_bos_token", "audio_bos_token")}
    )
    assert active_parameters(thinker) == active_parameters(thinker.text_config)
    real = active_parameters(thinker_text_config(qwen_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE)))
    # 48 x (attention 18.9 M + router 0.26 M + 8 experts x 4.7 M) + lm_head 311 M
    assert real == 48 * (2048 * 4096 * 2 + 2 * 2048 * 512 + 2048 * 128 + 8 * 3 * 2048 * 768) + 152064 * 2048
    assert 3.0e9 < real < 3.1e9
