"""Active parameters of a causal LM, from its transformers config: the weights one token's forward multiplies by, the N
of the 2N FLOPs per token of a forward (6N for forward and backward).

Counted: each layer's attention projections (q, k, v, o), its MLP (a dense layer's gate, up and down; a MoE layer's
router, the top-k experts' gate, up and down and a shared expert where the config has one) and the lm_head. Not
counted: the input embedding (a lookup, no matmul), norms and biases (no matmul FLOPs worth counting), the attention
scores themselves (they grow with the sequence length, not the parameters), and a multimodal model's vision and audio
towers (a text-only update never runs them).
"""

from __future__ import annotations


def moe_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` is a MoE layer (transformers' Qwen3-MoE rule: experts, not in mlp_only_layers, and
    every decoder_sparse_step-th layer)."""
    if getattr(config, "num_experts", 0) <= 0 or layer in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    return (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0


def active_parameters(config) -> int:
    """Active parameters per token of a causal LM's text config (module docstring): a dense model's matmul weights
    less its input embedding; for a MoE, with only the top-k experts of each MoE layer."""
    config = config.get_text_config()
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    total = vocab * hidden  # lm_head
    for layer in range(config.num_hidden_layers):
        if moe_layer(config, layer):
            mlp = hidden * config.num_experts + config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            mlp += 3 * hidden * shared + (hidden if shared else 0)  # a shared expert and its gate
        else:
            mlp = 3 * hidden * config.intermediate_size
        total += attention + mlp
    return total
