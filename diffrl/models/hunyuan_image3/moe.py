"""HunyuanImage-3.0's decoder-only mixture-of-experts transformer (the backbone shared by text and image tokens).

Paper: "HunyuanImage 3.0 Technical Report" (Tencent Hunyuan, arXiv 2509.23951); reference code
github.com/Tencent-Hunyuan/HunyuanImage-3.0 (`hunyuan_image_3/hunyuan.py`: `HunyuanImage3SDPAAttention`,
`HunyuanMLP`, `HunyuanTopKGate` + `topkgating`, `HunyuanMoE`, `HunyuanImage3DecoderLayer`, `build_2d_rope`).
Written from them here:

- Attention: one fused `qkv_proj` whose output is laid out per key-value head as [its query heads | key | value]
  (grouped-query attention), RoPE on q and k, then per-head RMS norms (`query_layernorm`, `key_layernorm`; the
  reference applies them after RoPE), SDPA under a boolean mask, `o_proj`. No biases.
- MLP (experts and the shared expert): SwiGLU with one fused `gate_and_up_proj`; its output halves are (x1, x2) and
  the result is `down_proj(x1 * silu(x2))` (the second half is the gate).
- MoE (`use_mixed_mlp_moe`): a router `gate.wg` (fp32, no bias) over `num_experts`, softmax over all experts, the
  top `moe_topk` kept and renormalised to sum 1 (`norm_topk_prob`; else scaled by `routed_scaling_factor`), the
  weighted sum of those experts' outputs plus the shared MLP (`shared_mlp`, width moe_intermediate_size x
  num_shared_expert) applied to every token. No token is dropped (the reference's capacity equals the busiest
  expert's load when `moe_drop_tokens` is false, its released setting), so routing is per token.
- Layers are pre-norm residual (RMS norms `input_layernorm`, `post_attention_layernorm`); the final `ln_f` is used
  for text logits only (the image head reads the last layer's hidden states without it), so it is not built.
- Generalised 2D RoPE (kexue.fm/archives/10352, the reference's `build_2d_rope`): every token has a (y, x) position;
  text and marker tokens y = x = their index, an h x w image starting at sequence index L has y = L + (hw - h)/2 + row,
  x = L + (hw - w)/2 + col (truncated to integers as the reference's `.long()`), and the tokens after it continue
  at L + hw. Frequency pair i of the head uses theta_i = base^(-2i/d) on y for even i and on x for odd i, with the
  half-split rotation; for text it is ordinary 1D RoPE.

RoPE and the q/k norms run in fp32 whatever the model dtype (the reference's fp32 cos/sin tables promote them).

Deviation: the expert dispatch loops over the experts that received tokens (index_select / index_add) instead of
the reference's dense one-hot einsum; the sums are the same up to float rounding.

Legend: B batch, S sequence, D hidden size, H query heads, G key-value heads, Dh head dim, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffrl.models.hunyuan_image3.config import HunyuanImage3Config


class RMSNorm(nn.Module):
    """T5-style RMS norm in fp32 (`HunyuanRMSNorm`): weight * x / sqrt(mean(x^2) + eps)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_2d(y_BS: torch.Tensor, x_BS: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, S, Dh) fp32 of the generalised 2D RoPE for integer positions y, x (B, S)."""
    if head_dim % 4:
        raise ValueError(f"attention_head_dim={head_dim} must be a multiple of 4 for HunyuanImage-3.0's 2D RoPE")
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=y_BS.device, dtype=torch.float32) / head_dim))
    pos = torch.stack([y_BS, x_BS], dim=-1).float()  # (B, S, 2)
    angles = (pos[..., None, :] * theta.reshape(head_dim // 4, 2)).reshape(*y_BS.shape, head_dim // 2)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, config: HunyuanImage3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        if self.heads % self.kv_heads:
            raise ValueError(f"num_attention_heads={self.heads} must be a multiple of num_key_value_heads")
        width = self.head_dim * (self.heads + 2 * self.kv_heads)
        self.qkv_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.head_dim * self.heads, config.hidden_size, bias=config.attention_bias)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x_BSD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor, mask_B1SS: torch.Tensor):
        batch, seq, _ = x_BSD.shape
        groups = self.heads // self.kv_heads
        qkv = self.qkv_proj(x_BSD).reshape(batch, seq, self.kv_heads, groups + 2, self.head_dim)
        q, k, v = torch.split(qkv, [groups, 1, 1], dim=3)
        q = q.reshape(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        # RoPE and the q/k norms in fp32, as the reference's fp32 cos/sin promote them, then back to v's dtype
        cos, sin, q, k = cos_BSd[:, None], sin_BSd[:, None], q.float(), k.float()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q, k = self.query_layernorm(q), self.key_layernorm(k)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask_B1SS)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU with a fused gate_and_up_proj: down_proj(x1 * silu(x2)), (x1, x2) the two output halves."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.gate_and_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(x1 * F.silu(x2))


class Router(nn.Module):
    """`HunyuanTopKGate`: fp32 logits `wg(x)`, softmax over all experts, top-k renormalised."""

    def __init__(self, config: HunyuanImage3Config, layer: int):
        super().__init__()
        self.topk = config.per_layer("moe_topk", layer)
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.wg = nn.Linear(config.hidden_size, config.per_layer("num_experts", layer), bias=False)

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, K) fp32, expert ids (N, K))."""
        logits = F.linear(x_ND.float(), self.wg.weight.float())
        gates = logits.softmax(dim=-1)
        weights, experts = torch.topk(gates, self.topk, dim=-1)
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
        else:
            weights = weights * self.scaling
        return weights, experts


class MoE(nn.Module):
    """Routed experts plus the shared MLP, as `HunyuanMoE` with use_mixed_mlp_moe."""

    def __init__(self, config: HunyuanImage3Config, layer: int):
        super().__init__()
        if not config.use_mixed_mlp_moe:
            raise ValueError("use_mixed_mlp_moe=false (no shared expert) is not HunyuanImage-3.0's layout")
        width = config.per_layer("moe_intermediate_size", layer)
        shared = width * config.per_layer("num_shared_expert", layer)
        self.shared_mlp = MLP(config.hidden_size, shared, config.mlp_bias)
        self.gate = Router(config, layer)
        num_experts = config.per_layer("num_experts", layer)
        self.experts = nn.ModuleList(MLP(config.hidden_size, width, config.mlp_bias) for _ in range(num_experts))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        flat = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights_NK, experts_NK = self.gate(flat)
        out = torch.zeros_like(flat)
        token_N = torch.arange(flat.shape[0], device=flat.device)[:, None].expand_as(experts_NK)
        for e in torch.unique(experts_NK).tolist():  # only the experts that got tokens
            hit = experts_NK == e
            rows, w = token_N[hit], weights_NK[hit]
            out = out.index_add(0, rows, self.experts[e](flat[rows]) * w[:, None].to(flat.dtype))
        return (self.shared_mlp(x_BSD) + out.reshape(x_BSD.shape)).to(x_BSD.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: HunyuanImage3Config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.per_layer("num_experts", layer) > 1 and layer >= config.moe_layer_num_skipped:
            self.mlp = MoE(config, layer)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x_BSD, cos_BSd, sin_BSd, mask_B1SS):
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), cos_BSd, sin_BSd, mask_B1SS)
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))


class Backbone(nn.Module):
    """`HunyuanImage3Model` less `ln_f`: token embedding `wte` and the decoder layers."""

    def __init__(self, config: HunyuanImage3Config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
