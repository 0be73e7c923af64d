"""FLUX.1-Kontext (diffusers `FluxKontextPipeline`: input image + instruction -> edited image) as a diffrl model
adapter; the denoiser, text encoders, schedule, noise, guidance embedding and decoding are FLUX.1's
(diffrl/models/flux/adapter.py).

Upstream details reproduced here (diffusers 0.42.1 `pipelines/flux/pipeline_flux_kontext.py`):
- the input image is resized to the entry of `PREFERRED_KONTEXT_RESOLUTIONS` (about 1024x1024 pixels) closest to its
  aspect ratio, sides rounded down to multiples of 16, with the pipeline's `image_processor.resize`, then
  preprocessed to [-1, 1];
- its VAE latents (the posterior's mode, `(z - shift_factor) * scaling_factor`) are packed 2x2 into (1, L', 64) tokens
  with position ids (1, row, col) (the noisy latents have (0, row, col));
- each forward takes [noisy latents, image latents] along the sequence; the velocity is the output's first L tokens.
  mu of the schedule uses L only. FLUX.1-Kontext-dev is guidance-distilled: one forward, no negative prompt.
Deviations: the output size is the rollout's height x width; upstream first rescales the requested size to
`max_area` (default 1024x1024) at its aspect ratio, so parity holds with `max_area = height * width`.
`condition_area` (the config's `model.condition_area`) resizes input images to that pixel area at their aspect ratio
(sides rounded down to multiples of 16) instead of the preferred resolutions: tests use it to keep tiny models fast;
for an image whose sides are already multiples of 16 and whose area it is, this equals upstream with
`_auto_resize=False`. Samples whose input images have different grids run in separate forwards. The pipeline's
`true_cfg_scale` with a negative prompt and IP-adapter inputs are not supported.

Where the image comes from: `encode_prompt(prompts, images=[...])`, one image (a path or a PIL image) per prompt; the
rollout engine passes each sample's metadata["image"] and keys its embedding cache by the prompt and the image file's
content digest. The encoding carries the image latents, so the VAE encodes an input image once, like the text.

Legend: B batch, L noisy image tokens, L' input-image tokens, T text tokens, D joint_attention_dim, P pooled dim.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS
from PIL import Image

from diffrl.models.base import (
    Encoding,
    SampleShape,
    by_image_grid,
    check_input_images,
    load_image,
    load_pipeline,
    pad_and_cat,
    register_adapter,
)
from diffrl.models.flux.adapter import FluxAdapter


@register_adapter
class FluxKontextAdapter(FluxAdapter):
    """FLUX.1-Kontext-dev: FLUX.1 conditioned on an input image's VAE latents along the token sequence."""

    arch = "flux_kontext"
    pipeline_classes = ("FluxKontextPipeline",)
    input_image: ClassVar[bool] = True
    default_guidance_scale = 2.5  # FLUX.1-Kontext-dev's recommended distilled guidance (the pipeline's default: 3.5)
    condition_area: int | None = None  # None: upstream's preferred resolutions

    @classmethod
    def from_pretrained(
        cls, path: str, *, device="cpu", dtype=torch.float32, condition_area: int | None = None, **kwargs
    ) -> "FluxKontextAdapter":
        """Load a FluxKontextPipeline folder. `condition_area`: the pixel area input images are resized to (None:
        upstream's preferred ~1024x1024 resolutions)."""
        if kwargs:
            raise ValueError(f"unexpected options for flux_kontext: {sorted(kwargs)}; it takes condition_area")
        if condition_area is not None and condition_area < 16 * 16:
            raise ValueError(f"condition_area={condition_area} must be at least 16 x 16 pixels")
        adapter = cls(load_pipeline(FluxKontextPipeline, path, device=device, dtype=dtype), device=device, dtype=dtype)
        adapter.source = path
        adapter.condition_area = condition_area
        return adapter

    def fingerprint(self) -> str:
        """The text-encoding side's id; a condition_area changes every encoding, so it is part of it."""
        base = super().fingerprint()
        return base if self.condition_area is None else f"{base}-area{self.condition_area}"

    def _input_size(self, image: Image.Image) -> tuple[int, int]:
        """(height, width) the input image is resized to, sides multiples of 16."""
        multiple = self.pipe.vae_scale_factor * 2
        height, width = self.pipe.image_processor.get_default_height_width(image)
        ratio = width / height
        if self.condition_area is None:  # upstream's _auto_resize
            _, width, height = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        else:
            width, height = round((self.condition_area * ratio) ** 0.5), round((self.condition_area / ratio) ** 0.5)
        return max(height // multiple, 1) * multiple, max(width // multiple, 1) * multiple

    @torch.no_grad()
    def encode_prompt(
        self,
        prompts: list[str],
        *,
        max_sequence_length: int | None = None,
        images: list[str | Image.Image] | None = None,
    ) -> Encoding:
        """FLUX.1's {"prompt_embeds": (B, T, D), "pooled_prompt_embeds": (B, P)} plus each prompt's input image:
        "image_latents" (B, L', 64) and "image_grid" (B, 2) int64 token rows and columns of L' (right-padded)."""
        check_input_images(self.arch, prompts, images)
        text = super().encode_prompt(prompts, max_sequence_length=max_sequence_length)
        parts = [self._encode_image(load_image(image)) for image in images]
        return dict(text, **pad_and_cat(parts))

    def _encode_image(self, image: Image.Image) -> Encoding:
        pipe = self.pipe
        height, width = self._input_size(image)
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, height, width), height, width)
        latents = pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
        channels, rows, cols = latents.shape[1:]
        return {
            "image_latents": pipe._pack_latents(latents, 1, channels, rows, cols).to(self.dtype),
            "image_grid": torch.tensor([[rows // 2, cols // 2]], dtype=torch.long, device=self.device),
        }

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        encoding: Encoding,
        negative: Encoding | None,
        *,
        guidance_scale: float,
        shape: SampleShape,
    ) -> torch.Tensor:
        """Velocity (B, L, 64) fp32 on the noisy tokens, the input image's latents riding along the sequence; one
        forward per input-image grid."""

        def run(rows: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
            part = {k: v[rows] for k, v in encoding.items()}
            return self._velocity_grid(latents[rows], sigma[rows], part, grid, guidance_scale, shape)

        return by_image_grid(latents, encoding, run)

    def _velocity_grid(self, latents, sigma, encoding, grid, guidance_scale, shape) -> torch.Tensor:
        length = latents.shape[1]
        image_tokens = encoding["image_latents"][:, : grid[0] * grid[1]].to(self.device, self.dtype)
        image_ids = self.pipe._prepare_latent_image_ids(1, grid[0], grid[1], self.device, self.dtype)
        image_ids[..., 0] = 1  # the input image's ids: (1, row, col), as upstream
        h, w = self._latent_hw(shape)
        latent_ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)
        hidden = torch.cat([latents.to(self.device, self.dtype), image_tokens], dim=1)
        img_ids = torch.cat([latent_ids, image_ids])
        return self._forward(hidden, sigma, encoding, guidance_scale, img_ids)[:, :length]
