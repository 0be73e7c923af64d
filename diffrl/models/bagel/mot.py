"""BAGEL's Mixture-of-Transformers language model, the generation path only (text-to-image).

Paper: "Emerging Properties in Unified Multimodal Pretraining" (Deng et al., arXiv 2505.14683); reference code
github.com/ByteDance-Seed/Bagel (`modeling/bagel/qwen2_navit.py`, `modeling/bagel/bagel.py`). Written from them here:

- A Qwen2 decoder whose every layer holds two experts: the understanding expert (Qwen2's own q/k/v/o projections,
  q/k RMS norms, input / post-attention RMS norms and MLP) and the generation expert (the same modules suffixed
  `_moe_gen`). Text tokens and the <|vision_start|> / <|vision_end|> markers go through the understanding expert,
  latent-patch tokens through the generation expert; one self-attention runs over the whole sequence. The final
  RMS norm is per expert too (`norm`, `norm_moe_gen`).
- Text-to-image context: `[<|im_start|>] + prompt ids + [<|im_end|>]` at RoPE positions 0..T-1, attending causally
  (upstream fills its KV cache with them in "und" mode); then `<|vision_start|>`, the h x w latent tokens and
  `<|vision_end|>`, all at the one RoPE position T, attending to the whole text and to each other (no causal mask).
- A latent token is `vae2llm(2x2 latent patch) + time_embedder(t) + latent_pos_embed[row * max_latent_size + col]`
  (the fixed 2D sin-cos table), and the velocity is `llm2vae(final hidden state)` of the latent tokens.

Deviations (numerics only): upstream caches the prompt's keys/values once and attends over them with flash-attn
varlen; here every forward runs the prompt tokens too (same values: they never attend to the image) under one
boolean mask with PyTorch SDPA, so a batch of prompts of different lengths is padded text with masked keys. Upstream
hard-casts the generation path to bf16 around the q/k norms and RoPE (in fp32) and the attention (bf16); here the
norms and RoPE run in fp32 and everything else in the module's dtype, so on the CPU in fp32 it is fp32 throughout.
The understanding-only parts of the checkpoint (lm_head, the SigLIP ViT and its connector) are not built.

Legend: B batch, T text slots (padded), L latent tokens, U = T + 2 understanding tokens, S = U + L, D hidden size,
P = p * p * C the patch size of a latent token (p latent_patch_size, C VAE latent channels), H heads, Dh head dim.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm, Qwen2RotaryEmbedding, apply_rotary_pos_emb


def sincos_2d_table(grid: int, dim: int) -> torch.Tensor:
    """(grid * grid, dim) fp32: BAGEL's fixed 2D sin-cos position table (MAE/DiT's), row-major over (row, col);
    the first dim/2 channels encode the row, the rest the column, each as [sin | cos] of pos * 10000^(-2i/(dim/2))."""
    if dim % 4 != 0:
        raise ValueError(f"hidden_size={dim} must be a multiple of 4 for BAGEL's 2D sin-cos position table")

    def one_axis(pos: np.ndarray, d: int) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    rows, cols = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32), indexing="ij")
    table = np.concatenate([one_axis(rows, dim // 2), one_axis(cols, dim // 2)], axis=1)
    return torch.from_numpy(table).float()


class TimestepEmbedder(nn.Module):
    """DiT's timestep embedder: 256 sinusoidal frequencies [cos | sin] of t (BAGEL feeds t in [0, 1] unscaled),
    then Linear-SiLU-Linear."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t_B: torch.Tensor) -> torch.Tensor:
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
        args = t_B.float()[:, None] * freqs[None]
        t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class PositionEmbedding(nn.Module):
    """The frozen 2D sin-cos table, named as in the checkpoint (`latent_pos_embed.pos_embed`). Upstream keeps it a
    parameter with requires_grad=False; here it is a (persistent) buffer, so full fine-tuning never trains it."""

    def __init__(self, max_num_patch_per_side: int, hidden_size: int):
        super().__init__()
        self.register_buffer("pos_embed", sincos_2d_table(max_num_patch_per_side, hidden_size))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[position_ids]


class MoTAttention(nn.Module):
    """Shared self-attention with per-expert q/k/v/o projections and q/k RMS norms (Qwen2: q/k/v biased, o not)."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        d, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, d // heads
        for suffix in ("", "_moe_gen"):
            setattr(self, f"q_proj{suffix}", nn.Linear(d, heads * self.head_dim, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(d, kv * self.head_dim, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(d, kv * self.head_dim, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(heads * self.head_dim, d, bias=False))
            setattr(self, f"q_norm{suffix}", Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps))
            setattr(self, f"k_norm{suffix}", Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps))

    def _qkv(self, x_BND: torch.Tensor, suffix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x_BND.shape
        q = getattr(self, f"q_proj{suffix}")(x_BND).view(b, n, self.num_heads, self.head_dim)
        k = getattr(self, f"k_proj{suffix}")(x_BND).view(b, n, self.num_kv_heads, self.head_dim)
        v = getattr(self, f"v_proj{suffix}")(x_BND).view(b, n, self.num_kv_heads, self.head_dim)
        # q/k norms in fp32 (upstream's generation path upcasts around them and RoPE)
        q = getattr(self, f"q_norm{suffix}")(q.float())
        k = getattr(self, f"k_norm{suffix}")(k.float())
        return q, k, v

    def forward(self, und_BUD, gen_BLD, cos_BSd, sin_BSd, mask_B1SS) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention outputs (und (B, U, D), gen (B, L, D)) over the concatenated sequence [und | gen]."""
        q_u, k_u, v_u = self._qkv(und_BUD, "")
        q_g, k_g, v_g = self._qkv(gen_BLD, "_moe_gen")
        q = torch.cat([q_u, q_g], dim=1).transpose(1, 2)  # (B, H, S, Dh)
        k = torch.cat([k_u, k_g], dim=1).transpose(1, 2)
        v = torch.cat([v_u, v_g], dim=1).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos_BSd, sin_BSd, unsqueeze_dim=1)
        dtype = und_BUD.dtype
        out = F.scaled_dot_product_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask_B1SS, enable_gqa=self.num_heads != self.num_kv_heads
        )
        out = out.transpose(1, 2).flatten(2)  # (B, S, H * Dh)
        u = und_BUD.shape[1]
        return self.o_proj(out[:, :u]), self.o_proj_moe_gen(out[:, u:])


class MoTDecoderLayer(nn.Module):
    """One Qwen2MoTDecoderLayer: pre-norm attention and MLP, each expert with its own norms and MLP."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.self_attn = MoTAttention(config)
        self.mlp = Qwen2MLP(config)
        self.mlp_moe_gen = Qwen2MLP(config)
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(self, name, Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps))
            setattr(self, f"{name}_moe_gen", Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, und_BUD, gen_BLD, cos_BSd, sin_BSd, mask_B1SS, last: bool = False):
        a_und, a_gen = self.self_attn(
            self.input_layernorm(und_BUD), self.input_layernorm_moe_gen(gen_BLD), cos_BSd, sin_BSd, mask_B1SS
        )
        und_BUD, gen_BLD = und_BUD + a_und, gen_BLD + a_gen
        gen_BLD = gen_BLD + self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(gen_BLD))
        if not last:  # after the last attention nothing reads the understanding tokens
            und_BUD = und_BUD + self.mlp(self.post_attention_layernorm(und_BUD))
        return und_BUD, gen_BLD


class _Backbone(nn.Module):
    """`language_model.model` of the checkpoint: the token embedding, the MoT layers and the final norms."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MoTDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_moe_gen = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config=config)


class _LanguageModel(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.model = _Backbone(config)


class BagelMoT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """BAGEL's denoiser for text-to-image: the MoT LLM plus the generation connectors, with the checkpoint's names
    (`language_model.model.layers.N.self_attn.q_proj_moe_gen`, `vae2llm`, `llm2vae`, `time_embedder`,
    `latent_pos_embed`), so `ema.safetensors` loads into it key for key (less lm_head and the ViT side)."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["MoTDecoderLayer"]

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 152064,
        hidden_size: int = 3584,
        intermediate_size: int = 18944,
        num_hidden_layers: int = 28,
        num_attention_heads: int = 28,
        num_key_value_heads: int = 4,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1000000.0,
        max_position_embeddings: int = 32768,
        latent_channels: int = 16,
        latent_patch_size: int = 2,
        max_latent_size: int = 64,
    ):
        super().__init__()
        llm = Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            hidden_act=hidden_act,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings,
        )
        self.language_model = _LanguageModel(llm)
        patch_dim = latent_patch_size**2 * latent_channels
        self.time_embedder = TimestepEmbedder(hidden_size)
        self.vae2llm = nn.Linear(patch_dim, hidden_size)
        self.llm2vae = nn.Linear(hidden_size, patch_dim)
        self.latent_pos_embed = PositionEmbedding(max_latent_size, hidden_size)
        self.gradient_checkpointing = False

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.model.layers

    def latent_position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """(rows * cols,) row-major ids into the max_latent_size x max_latent_size table (upstream's "extrapolate")."""
        side = self.config.max_latent_size
        if rows > side or cols > side:
            raise ValueError(
                f"a {rows}x{cols} latent-token grid exceeds this BAGEL's max_latent_size={side} per side "
                f"(at most {side * 16} pixels per side with the FLUX VAE and 2x2 patches)"
            )
        return (torch.arange(rows)[:, None] * side + torch.arange(cols)[None]).flatten()

    def forward(
        self,
        latents_BLP: torch.Tensor,
        timestep_B: torch.Tensor,
        text_ids_BT: torch.Tensor,
        text_mask_BT: torch.Tensor,
        marker_ids: tuple[int, int],
        grid: tuple[int, int],
    ) -> torch.Tensor:
        """Velocity (B, L, P) of the latent tokens x_t at times t (B,) given each sample's text (ids (B, T) and mask
        (B, T), 1 = a real token; a row of zeros = no text, BAGEL's text-CFG branch). marker_ids: the
        <|vision_start|>, <|vision_end|> ids; grid: (rows, cols) of latent tokens."""
        batch = text_ids_BT.shape[0]
        embed = self.language_model.model.embed_tokens
        markers = embed(torch.tensor(marker_ids, device=latents_BLP.device)).expand(batch, 2, -1)
        und = torch.cat([embed(text_ids_BT), markers], dim=1)
        pos_ids = self.latent_position_ids(*grid).to(latents_BLP.device)
        gen = (
            self.vae2llm(latents_BLP.to(und.dtype))
            + self.time_embedder(timestep_B)[:, None]
            + self.latent_pos_embed(pos_ids).to(und.dtype)[None]
        )
        mask, positions = _mask_and_positions(text_mask_BT, latents_BLP.shape[1])
        cos, sin = self.language_model.model.rotary_emb(gen.float(), positions)
        layers = self.layers
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                und, gen = self._gradient_checkpointing_func(layer, und, gen, cos, sin, mask, last)
            else:
                und, gen = layer(und, gen, cos, sin, mask, last)
        return self.llm2vae(self.language_model.model.norm_moe_gen(gen))


def _mask_and_positions(text_mask_BT: torch.Tensor, num_latents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, 1, S, S) boolean attention mask (True = attend) and (B, S) RoPE positions of [text | markers | latents].

    Text query i sees text keys j <= i (causal, real tokens only); the two markers and the latents see every real
    text token and each other. A padded text slot sees the real text before it and itself (its output is never
    read; a row with no key at all would be NaN). Positions: text 0..n-1, everything after the text at n (n = the
    sample's real text tokens).
    """
    batch, t_slots = text_mask_BT.shape
    device = text_mask_BT.device
    real = text_mask_BT.bool()
    n_B = real.sum(dim=1)
    size = t_slots + 2 + num_latents
    key_real = torch.cat([real, torch.ones(batch, size - t_slots, dtype=torch.bool, device=device)], dim=1)
    mask = key_real[:, None, :].expand(batch, size, size).clone()
    causal = torch.ones(t_slots, t_slots, dtype=torch.bool, device=device).tril()
    mask[:, :t_slots, :t_slots] &= causal
    mask[:, :t_slots, t_slots:] = False  # text never sees the image
    eye = torch.eye(t_slots, dtype=torch.bool, device=device)
    mask[:, :t_slots, :t_slots] |= eye & ~real[:, :, None]
    text_pos = torch.arange(t_slots, device=device).expand(batch, t_slots)
    image_pos = n_B[:, None].expand(batch, size - t_slots)
    return mask[:, None], torch.cat([text_pos, image_pos], dim=1)
