"""HunyuanImage-3.0's image-generation path: latents in, velocity out, through the MoE backbone (moe.py).

Reference: github.com/Tencent-Hunyuan/HunyuanImage-3.0 `hunyuan_image_3/hunyuan.py` (`HunyuanImage3ForCausalMM`:
`instantiate_vae_image_tokens`, `instantiate_timestep_tokens`, `ragged_final_layer`, `forward` in "gen_image" mode,
`_prepare_attention_mask_for_generation`; `TimestepEmbedder`, `ResBlock`, `UNetDown`, `UNetUp`) and
`tokenizer_wrapper.py` (the sequence of the "pretrain" template). Written from them here:

- Sequence of one sample: `<bos> prompt <boi> <img_size_{base}> <img_ratio_{i}> <timestep> <img> x (h w) <eoi>`.
  The `<timestep>` slot holds `timestep_emb(t)`; the image slots hold `patch_embed(x_t, time_embed(t))`, the
  latent (C, h, w) through a 3x3 conv and a timestep-conditioned ResBlock (patch_size 1: one latent pixel = one
  token, row-major); every other slot its token embedding. t is the reference's timestep, 1000 x sigma.
- Attention mask: causal, except that the image tokens see each other (full attention inside the image).
- Output: the last layer's hidden states at the image slots (no final norm) through `final_layer`
  (a ResBlock conditioned on `time_embed_2(t)`, GroupNorm, SiLU, 3x3 conv) back to (C, h, w): the velocity.
- ResBlock: GroupNorm(32)-SiLU-conv3x3, then GroupNorm scaled and shifted by Linear(SiLU(emb)) ("adaptive group
  norm"), SiLU, conv3x3, plus a 1x1-conv skip when the width changes. Timestep embedders: 256 sinusoidal
  frequencies [cos | sin] of t (max period 10000), Linear-GELU-Linear.

Deviation: the reference samples with a static KV cache (the prompt's keys/values computed at the first step,
only <timestep> + image tokens recomputed after); here each forward runs the whole sequence (the same values:
the prompt never attends to the image). Prompts of different lengths share a batch as right-padded text slots
whose keys are masked; every later token's RoPE position is counted from the sample's real text length, so a
sample's result does not depend on its batch. The VAE encoder, the SigLIP2 ViT and its aligner (image inputs),
`ln_f` and `lm_head` (text output) are not built.

Legend: B batch, T text slots (with <bos>), h w latent grid, L = h w image tokens, S sequence, D hidden, C latent
channels.
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from diffrl.models.hunyuan_image3.config import HunyuanImage3Config
from diffrl.models.hunyuan_image3.moe import Backbone, rope_2d

MARKERS = ("boi", "size", "ratio", "timestep")  # the slots between the prompt and the image


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t_B: torch.Tensor) -> torch.Tensor:
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
        args = t_B.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([args.cos(), args.sin()], dim=-1).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    """The reference's `ResBlock` (no up/down sampling; patch_size 1)."""

    def __init__(self, in_channels: int, emb_channels: int, out_channels: int):
        super().__init__()
        self.in_layers = nn.Sequential(
            nn.GroupNorm(32, in_channels), nn.SiLU(), nn.Conv2d(in_channels, out_channels, 3, padding=1)
        )
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, 2 * out_channels))
        self.out_layers = nn.Sequential(
            nn.GroupNorm(32, out_channels),
            nn.SiLU(),
            nn.Dropout(0.0),
            nn.Conv2d(out_channels, out_channels, 3, padding=1),
        )
        if in_channels == out_channels:
            self.skip_connection = nn.Identity()
        else:
            self.skip_connection = nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x_BCHW: torch.Tensor, emb_BE: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x_BCHW)
        scale, shift = self.emb_layers(emb_BE)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1 + scale) + shift
        return self.skip_connection(x_BCHW) + self.out_layers[1:](h)


class UNetDown(nn.Module):
    """`patch_embed`: conv3x3 (C -> hidden_dim), ResBlock (hidden_dim -> D); tokens row-major."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, out_channels: int):
        super().__init__()
        self.model = nn.ModuleList(
            [
                nn.Conv2d(in_channels, hidden_channels, 3, padding=1),
                ResBlock(hidden_channels, emb_channels, out_channels),
            ]
        )

    def forward(self, x_BCHW: torch.Tensor, emb_BE: torch.Tensor) -> torch.Tensor:
        h = self.model[1](self.model[0](x_BCHW), emb_BE)
        return h.flatten(2).transpose(1, 2)  # (B, L, D)


class UNetUp(nn.Module):
    """`final_layer`: ResBlock (D -> hidden_dim), then GroupNorm, SiLU, conv3x3 (hidden_dim -> C) (out_norm)."""

    def __init__(self, in_channels: int, emb_channels: int, hidden_channels: int, out_channels: int):
        super().__init__()
        self.model = nn.ModuleList(
            [
                ResBlock(in_channels, emb_channels, hidden_channels),
                nn.Sequential(
                    nn.GroupNorm(32, hidden_channels), nn.SiLU(), nn.Conv2d(hidden_channels, out_channels, 3, padding=1)
                ),
            ]
        )

    def forward(self, x_BLD: torch.Tensor, emb_BE: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        x = x_BLD.transpose(1, 2).reshape(x_BLD.shape[0], -1, rows, cols)
        return self.model[1](self.model[0](x, emb_BE))


class HunyuanImage3Transformer(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """The text-to-image denoiser with the checkpoint's names (`model.wte`, `model.layers.N.self_attn.qkv_proj`,
    `model.layers.N.mlp.experts.E.gate_and_up_proj`, `timestep_emb`, `time_embed`, `time_embed_2`, `patch_embed`,
    `final_layer`), so the safetensors shards load into it key for key (less the parts listed above)."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]

    @register_to_config
    def __init__(self, hunyuan_config: dict):
        super().__init__()
        self.hy = HunyuanImage3Config.from_dict(dict(hunyuan_config))
        hidden, width, channels = self.hy.hidden_size, self.hy.patch_embed_hidden_dim, self.hy.latent_channels
        self.model = Backbone(self.hy)
        self.timestep_emb = TimestepEmbedder(hidden)
        self.time_embed = TimestepEmbedder(hidden)
        self.time_embed_2 = TimestepEmbedder(hidden)
        self.patch_embed = UNetDown(channels, hidden, width, hidden)
        self.final_layer = UNetUp(hidden, hidden, width, channels)
        self.gradient_checkpointing = False

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(
        self,
        latents_BCHW: torch.Tensor,
        timestep_B: torch.Tensor,
        text_ids_BT: torch.Tensor,
        text_mask_BT: torch.Tensor,
        token_ids: dict[str, int],
    ) -> torch.Tensor:
        """Velocity (B, C, h, w) at x_t (B, C, h, w) and the reference's timesteps t (B,) (1000 x sigma), given each
        sample's `<bos> prompt` (ids (B, T), mask (B, T): 1 = real). token_ids: the ids of boi, size, ratio,
        timestep, img, eoi (`<img_size_*>` / `<img_ratio_*>` of this image's shape)."""
        batch, _, rows, cols = latents_BCHW.shape
        device, wte = latents_BCHW.device, self.model.wte
        tail = [token_ids[k] for k in MARKERS] + [token_ids["img"]] * (rows * cols) + [token_ids["eoi"]]
        ids = torch.cat([text_ids_BT, torch.tensor(tail, device=device).expand(batch, -1)], dim=1)
        embeds = wte(ids)
        t_slot, first = text_ids_BT.shape[1] + 3, text_ids_BT.shape[1] + 4
        image = self.patch_embed(latents_BCHW.to(embeds.dtype), self.time_embed(timestep_B))
        embeds = torch.cat(
            [
                embeds[:, :t_slot],
                self.timestep_emb(timestep_B)[:, None].to(embeds.dtype),
                image.to(embeds.dtype),
                embeds[:, first + rows * cols :],
            ],
            dim=1,
        )
        y, x, mask = sequence_layout(text_mask_BT, rows, cols)
        cos, sin = rope_2d(y, x, self.hy.head_dim, self.hy.rope_theta)
        hidden = embeds
        for layer in self.model.layers:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden = self._gradient_checkpointing_func(layer, hidden, cos, sin, mask)
            else:
                hidden = layer(hidden, cos, sin, mask)
        out = hidden[:, first : first + rows * cols]
        return self.final_layer(out, self.time_embed_2(timestep_B), rows, cols)


def sequence_layout(text_mask_BT: torch.Tensor, rows: int, cols: int):
    """(y, x) RoPE positions (B, S) int64 and the (B, 1, S, S) boolean mask (True = attend) of
    [text slots | boi size ratio timestep | rows x cols image | eoi].

    A sample with n real text tokens: text at 0..n-1, the four markers at n..n+3, the image from L = n + 4 with the
    reference's 2D positions (y = L + (hw - h) // 2 + row, x = L + (hw - w) // 2 + col), eoi at L + hw. The mask is
    causal over the slots with the padded text keys removed, full inside the image; a padded slot also sees itself
    (its output is never read; a row with no key at all would be NaN).
    """
    batch, slots = text_mask_BT.shape
    device = text_mask_BT.device
    real = text_mask_BT.bool()
    n_B = real.sum(dim=1, keepdim=True)
    count, size = rows * cols, slots + 4 + rows * cols + 1
    text_pos = torch.arange(slots, device=device).expand(batch, slots)
    start = n_B + 4
    grid_r = torch.arange(rows, device=device).repeat_interleave(cols)
    grid_c = torch.arange(cols, device=device).repeat(rows)
    marker_pos = n_B + torch.arange(4, device=device)
    y = torch.cat([text_pos, marker_pos, start + (count - rows) // 2 + grid_r, start + count], dim=1)
    x = torch.cat([text_pos, marker_pos, start + (count - cols) // 2 + grid_c, start + count], dim=1)
    key_real = torch.cat([real, torch.ones(batch, size - slots, dtype=torch.bool, device=device)], dim=1)
    mask = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    image = slice(slots + 4, slots + 4 + count)
    mask[image, image] = True
    mask = mask[None] & key_real[:, None, :]
    mask |= torch.eye(size, dtype=torch.bool, device=device)[None]
    return y, x, mask[:, None]
