"""HunyuanImage-3.0's VAE decoder (`AutoencoderKLConv3D` of github.com/Tencent-Hunyuan/HunyuanImage-3.0,
`hunyuan_image_3/autoencoder_kl_3d.py`), written from it; text-to-image only decodes, so the encoder is not built.

The decoder is 3D-convolutional (a video VAE used on one frame): `conv_in` (+ the latent repeated across channels),
mid ResNet / single-head attention / ResNet, then per level `layers_per_block + 1` ResNet blocks and, on the first
log2(ffactor_spatial) levels, a DCAE-style upsample (conv to 4x or 8x channels and a depth-to-space shuffle, plus the
input repeated the same way as a shortcut; the first log2(ffactor_temporal) levels also double the frames),
GroupNorm-swish-`conv_out`. GroupNorms have 32 groups and eps 1e-6. For one latent frame the reference keeps the
last decoded frame (`decoded[:, :, -1:]`). Names as in the checkpoint (`vae.decoder.up.0.block.1.conv1.weight`).
Deviation: the reference's `Conv3d` splits very large inputs into chunks along time (within 1e-5 of one conv);
here it is one `nn.Conv3d`.

Legend: B batch, C channels, F frames, H W spatial.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(in_channels), nn.Conv3d(in_channels, out_channels, 3, padding=1)
        self.norm2, self.conv2 = _norm(out_channels), nn.Conv3d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v = (nn.Conv3d(channels, channels, 1) for _ in range(3))
        self.proj_out = nn.Conv3d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, f, h, w = x.shape
        n = self.norm(x)
        q, k, v = (m(n).reshape(b, 1, c, f * h * w).transpose(-1, -2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(-1, -2).reshape(b, c, f, h, w)
        return x + self.proj_out(out)


class UpsampleDCAE(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, temporal: bool):
        super().__init__()
        self.factor_t = 2 if temporal else 1
        factor = self.factor_t * 4
        self.conv = nn.Conv3d(in_channels, out_channels * factor, 3, padding=1)
        self.repeats = factor * out_channels // in_channels

    def _shuffle(self, x: torch.Tensor) -> torch.Tensor:
        # "b (r1 r2 r3 c) f h w -> b c (f r1) (h r2) (w r3)"
        b, _, f, h, w = x.shape
        r1 = self.factor_t
        x = x.reshape(b, r1, 2, 2, -1, f, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)
        return x.reshape(b, -1, f * r1, h * 2, w * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shuffle(self.conv(x)) + self._shuffle(x.repeat_interleave(self.repeats, dim=1))


class Decoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        z, blocks = int(config["latent_channels"]), [int(c) for c in reversed(config["block_out_channels"])]
        if blocks[0] % z:
            raise ValueError(f"vae block_out_channels[-1]={blocks[0]} must be a multiple of latent_channels={z}")
        spatial, temporal = int(config["ffactor_spatial"]), int(config["ffactor_temporal"])
        self.z_channels, self.first = z, blocks[0]
        self.conv_in = nn.Conv3d(z, blocks[0], 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1 = ResnetBlock(blocks[0], blocks[0]), AttnBlock(blocks[0])
        self.mid.block_2 = ResnetBlock(blocks[0], blocks[0])
        self.up = nn.ModuleList()
        channels = blocks[0]
        for level, width in enumerate(blocks):
            up = nn.Module()
            up.block = nn.ModuleList()
            for _ in range(int(config["layers_per_block"]) + 1):
                up.block.append(ResnetBlock(channels, width))
                channels = width
            if level < math.log2(spatial) or level < math.log2(temporal):
                out = blocks[level + 1] if config.get("upsample_match_channel", True) else channels
                up.upsample = UpsampleDCAE(channels, out, temporal=level < math.log2(temporal))
                channels = out
            self.up.append(up)
        self.norm_out, self.conv_out = _norm(channels), nn.Conv3d(channels, int(config["out_channels"]), 3, padding=1)

    def forward(self, z_BCFHW: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z_BCFHW) + z_BCFHW.repeat_interleave(self.first // self.z_channels, dim=1)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for up in self.up:
            for block in up.block:
                h = block(h)
            if hasattr(up, "upsample"):
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class HunyuanImage3VAE(nn.Module):
    """The decoder under the checkpoint's `vae.decoder.*` names, with the config's scaling/shift factors."""

    def __init__(self, config: dict):
        super().__init__()
        self.vae_config = dict(config)
        self.scaling_factor = config.get("scaling_factor")
        self.shift_factor = config.get("shift_factor")
        self.decoder = Decoder(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype

    def decode(self, latents_BCHW: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] of latents in the transformer's space, as the reference pipeline's end:
        divide by scaling_factor, add shift_factor (when set), decode one frame, keep the last decoded frame."""
        z = latents_BCHW
        if self.scaling_factor:
            z = z / self.scaling_factor
        if self.shift_factor:
            z = z + self.shift_factor
        frames = self.decoder(z[:, :, None].to(self.dtype))
        return frames[:, :, -1]
