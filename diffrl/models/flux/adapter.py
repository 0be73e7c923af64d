"""FLUX.1 (diffusers `FluxPipeline`) as a diffrl model adapter.

Mirrors diffusers 0.42.1 `pipeline_flux.py` at noise level 0:
- prompts: CLIP-L pooled output (77 tokens) + T5 last hidden state (`max_sequence_length`, default 512),
  computed by the pipeline's own `encode_prompt`; text position ids are zeros (L, 3).
- latents: drawn as (1, C, h, w) per sample, then packed 2x2 into (1, h/2 * w/2, 4C) tokens with image
  position ids (row, col) from `_prepare_latent_image_ids`.
- sigmas: `np.linspace(1, 1/N, N)` through set_timesteps with the dynamic shift `mu` computed from the
  packed image sequence length; the transformer sees timestep = (sigma * 1000 in the model dtype) / 1000.
- guidance: FLUX.1-dev is guidance-distilled: `guidance_scale` goes into the guidance embedding, one
  forward per step, no negative prompt (`needs_negative` is False). Checkpoints without a guidance
  embedding (FLUX.1-schnell) ignore guidance_scale, as upstream.
Not supported: the pipeline's optional `true_cfg_scale` (a second forward with a negative prompt),
IP-adapter, prompt_2. Height/width that are not multiples of 16 are an error here (upstream warns and
rounds down).

Legend: B batch, C latent channels (16), h, w latent height/width (image size / 8), T = h/2 * w/2 packed
image tokens, L text tokens, D joint_attention_dim, P pooled dim.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import (
    Encoding,
    ModelAdapter,
    SampleShape,
    check_image_shape,
    images_to_uint8,
    load_pipeline,
    register_adapter,
)
from diffrl.models.sd3.adapter import warn_if_truncated


@register_adapter
class FluxAdapter(ModelAdapter):
    """FLUX.1-dev / -schnell: CLIP pooled + T5 text, packed latents, distilled guidance embedding."""

    arch = "flux"
    pipeline_classes = ("FluxPipeline",)
    # diffusers' FLUX LoRA recipe (train_dreambooth_lora_flux): attention and MLP projections of the
    # double-stream blocks; "attn.to_q/k/v" also match the single-stream blocks' attention.
    default_lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    default_guidance_scale = 3.5
    default_max_sequence_length = 512  # the pipeline's default T5 length

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "FluxAdapter":
        """Load a FluxPipeline folder (ValueError naming the path when it is missing)."""
        if kwargs:
            raise ValueError(f"FluxAdapter.from_pretrained got unknown arguments {sorted(kwargs)}; it takes none")
        adapter = cls(load_pipeline(FluxPipeline, path, device=device, dtype=dtype), device=device, dtype=dtype)
        adapter.source = path
        return adapter

    def fsdp_wrap_units(self) -> list[torch.nn.Module]:
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    def needs_negative(self, guidance_scale: float) -> bool:
        return False  # distilled guidance: the guidance scale is an input of the model, no uncond pass

    def _latent_hw(self, shape: SampleShape) -> tuple[int, int]:
        factor = self.pipe.vae_scale_factor * 2  # VAE downsampling x 2x2 packing
        return 2 * (shape.height // factor), 2 * (shape.width // factor)

    def check_shape(self, shape: SampleShape) -> None:
        factor = self.pipe.vae_scale_factor
        check_image_shape(shape, factor * 2, "FLUX", f"VAE scale factor {factor} x 2x2 latent packing")

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, L, D), "pooled_prompt_embeds": (B, P)} exactly as the pipeline's
        `encode_prompt` (which this calls), in self.dtype on self.device."""
        length = max_sequence_length or self.default_max_sequence_length
        if not 0 < length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512] for FLUX (T5), got {length}")
        pipe = self.pipe
        warn_if_truncated(prompts, pipe.tokenizer, pipe.tokenizer_max_length, "CLIP")
        warn_if_truncated(prompts, pipe.tokenizer_2, length, "T5")
        prompt_embeds, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, num_images_per_prompt=1, max_sequence_length=length
        )
        return {"prompt_embeds": prompt_embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}

    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32 sigmas of a copy of the pipeline's scheduler after the pipeline's set_timesteps."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        scheduler = copy.deepcopy(self.pipe.scheduler)
        n = num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        h, w = self._latent_hw(shape)
        mu = calculate_shift(
            (h // 2) * (w // 2),
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        retrieve_timesteps(scheduler, n, "cpu", sigmas=sigmas, mu=mu)
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, T, 4C) fp32 packed noise: sample i is `randn_tensor((1, C, h, w), generators[i])` in the
        pipeline dtype, packed as `FluxPipeline._pack_latents`."""
        self.check_shape(shape)
        channels = self.transformer.config.in_channels // 4
        h, w = self._latent_hw(shape)
        draws = [
            self.pipe._pack_latents(
                randn_tensor((1, channels, h, w), generator=g, device=self.device, dtype=self.dtype), 1, channels, h, w
            )
            for g in generators
        ]
        return torch.cat(draws).to(torch.float32)

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
        """Velocity (B, T, 4C) fp32 at per-sample sigmas (B,), one forward with the guidance embedding
        set to `guidance_scale` (`negative` is not used: FLUX's guidance is distilled)."""
        h, w = self._latent_hw(shape)
        img_ids = self.pipe._prepare_latent_image_ids(latents.shape[0], h // 2, w // 2, self.device, self.dtype)
        return self._forward(latents, sigma, encoding, guidance_scale, img_ids)

    def _forward(
        self, hidden: torch.Tensor, sigma: torch.Tensor, encoding: Encoding, guidance_scale: float, img_ids
    ) -> torch.Tensor:
        """The transformer's output (B, len(img_ids), 4C) fp32 for the image tokens `hidden` at positions `img_ids`."""
        batch = hidden.shape[0]
        # As the pipeline: scheduler.timesteps (fp32 sigma * 1000) cast to the latents dtype, then / 1000.
        timestep = sigma.to(self.device, torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        timestep = timestep.to(self.dtype) / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), guidance_scale, device=self.device, dtype=torch.float32)
        prompt_embeds = encoding["prompt_embeds"].to(self.dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        out = self.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=timestep,
            guidance=guidance,
            pooled_projections=encoding["pooled_prompt_embeds"].to(self.dtype),
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out.to(torch.float32)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8: unpack, unscale/unshift, VAE decode, postprocess as the pipeline's "np"."""
        vae = self.pipe.vae
        x = self.pipe._unpack_latents(
            latents.to(self.device, vae.dtype), shape.height, shape.width, self.pipe.vae_scale_factor
        )
        x = x / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(x, return_dict=False)[0]
        return images_to_uint8(self.pipe.image_processor.postprocess(images, output_type="pt"))
