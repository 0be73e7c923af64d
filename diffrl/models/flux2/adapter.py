"""FLUX.2 (diffusers `Flux2KleinPipeline` and `Flux2Pipeline`) as a diffrl model adapter.

FLUX.2-klein (4B/9B, Qwen3 text encoder) and FLUX.2-dev (32B, Mistral-Small-3 text encoder) share one transformer
(`Flux2Transformer2DModel`), VAE (`AutoencoderKLFlux2`, with a batch norm over the patchified latents) and latent
layout; they differ in the text encoder and in guidance. Mirrors diffusers 0.42.1 `pipelines/flux2/` at noise level 0:
- prompts: the pipeline's own `encode_prompt` (a chat template, padded to `max_sequence_length` = 512, the hidden
  states of three layers stacked per token: (B, L, 3 D)); text position ids (0, 0, 0, l) for token l. No attention
  mask reaches the transformer (upstream attends to the padding too).
- latents: drawn as (1, 4C, h/2, w/2) per sample (already 2x2-patchified), then flattened row-major into (1, T, 4C)
  tokens with position ids (0, row, col, 0).
- sigmas: `np.linspace(1, 1/N, N)` through set_timesteps with `mu = compute_empirical_mu(T, N)`; the transformer sees
  timestep = (sigma * 1000 in the model dtype) / 1000.
- guidance: FLUX.2-dev is guidance-distilled (`guidance_scale` into the guidance embedding, one forward, no negative).
  FLUX.2-klein base runs CFG against the empty prompt when guidance_scale > 1: `uncond + g (cond - uncond)`, cond and
  uncond in one batched forward here (upstream runs two; every prompt is padded to the same length and nothing is
  masked, so the rows are independent). The step-distilled klein folders (`is_distilled: true`) ignore guidance.
- decode: tokens back to (B, 4C, h/2, w/2), un-normalise with the VAE's batch-norm running stats, unpatchify to
  (B, C, h, w), VAE decode, postprocess.
Not supported: reference images (the pipelines' `image=` editing input), caption upsampling (`Flux2Pipeline`'s
`caption_upsample_temperature`), custom `text_encoder_out_layers`. Height/width not multiples of 16 are an error
here (upstream warns and rounds down).

Legend: B batch, C VAE latent channels (32), h, w latent height/width (image size / 8), T = h/2 * w/2 image tokens,
L text tokens, D text encoder hidden size.
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
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
from diffrl.models.kind import RANDOM
from diffrl.models.sd3.adapter import warn_if_truncated


def _pipeline_class(path: str):
    """Flux2KleinPipeline or Flux2Pipeline, as the folder's model_index.json names it."""
    with open(os.path.join(path.removeprefix(RANDOM), "model_index.json")) as f:
        name = json.load(f).get("_class_name")
    return Flux2Pipeline if name == "Flux2Pipeline" else Flux2KleinPipeline


@register_adapter
class Flux2Adapter(ModelAdapter):
    """FLUX.2-klein / -dev: stacked LM hidden states as text, 2x2-patchified latents, CFG (klein) or a guidance
    embedding (dev)."""

    arch = "flux2"
    pipeline_classes = ("Flux2KleinPipeline", "Flux2Pipeline")
    # The attention and MLP projections of the double-stream blocks (image and text streams) and the fused
    # qkv+MLP input projection of the single-stream blocks (the FLUX.1 recipe's targets under FLUX.2's names). The
    # single blocks' output projection `attn.to_out` is left out: the name would also match the double blocks'
    # `to_out` list, which peft cannot wrap.
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
    )
    default_guidance_scale = 4.0  # both pipelines' `guidance_scale` default
    default_max_sequence_length = 512  # both pipelines' default (and `tokenizer_max_length`)

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "Flux2Adapter":
        """Load a Flux2KleinPipeline or Flux2Pipeline folder (ValueError naming the path when it is missing)."""
        if kwargs:
            raise ValueError(f"Flux2Adapter.from_pretrained got unknown arguments {sorted(kwargs)}; it takes none")
        pipeline_cls = Flux2KleinPipeline
        try:
            pipeline_cls = _pipeline_class(path)
        except FileNotFoundError:
            pass  # a Hub id, or a missing folder: load_pipeline raises the clear error for the latter
        adapter = cls(load_pipeline(pipeline_cls, path, device=device, dtype=dtype), device=device, dtype=dtype)
        adapter.source = path
        return adapter

    @property
    def guidance_distilled(self) -> bool:
        """Guidance goes into the transformer's guidance embedding (FLUX.2-dev), not through CFG."""
        return bool(self.transformer.config.guidance_embeds)

    def fsdp_wrap_units(self) -> list[torch.nn.Module]:
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    def needs_negative(self, guidance_scale: float) -> bool:
        """Klein base: CFG against the empty prompt when guidance_scale > 1; dev and step-distilled klein: never."""
        if self.guidance_distilled or self.pipe.config.get("is_distilled", False):
            return False
        return guidance_scale > 1.0

    def _token_hw(self, shape: SampleShape) -> tuple[int, int]:
        """(h/2, w/2): the image-token grid."""
        factor = self.pipe.vae_scale_factor * 2  # VAE downsampling x 2x2 patchify
        return shape.height // factor, shape.width // factor

    def check_shape(self, shape: SampleShape) -> None:
        factor = self.pipe.vae_scale_factor
        check_image_shape(shape, factor * 2, "FLUX.2", f"VAE scale factor {factor} x 2x2 latent patchify")

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, L, 3 D)} exactly as the pipeline's `encode_prompt` (which this calls), in self.dtype
        on self.device; L = max_sequence_length (every prompt is padded to it)."""
        length = max_sequence_length or self.default_max_sequence_length
        if not 0 < length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512] for FLUX.2, got {length}")
        # The chat template adds tokens around the prompt; the warning counts the prompt's own tokens only.
        warn_if_truncated(prompts, self.pipe.tokenizer, length, "FLUX.2 text encoder")
        prompt_embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, max_sequence_length=length)
        return {"prompt_embeds": prompt_embeds.to(self.dtype)}

    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32 sigmas of a copy of the pipeline's scheduler after the pipeline's set_timesteps."""
        # Adapted from diffrl/models/flux/adapter.py: FluxAdapter.sigmas (mu from compute_empirical_mu)
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        scheduler = copy.deepcopy(self.pipe.scheduler)
        n = num_inference_steps
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        th, tw = self._token_hw(shape)
        retrieve_timesteps(scheduler, n, "cpu", sigmas=sigmas, mu=compute_empirical_mu(th * tw, n))
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, T, 4C) fp32 noise: sample i is `randn_tensor((1, 4C, h/2, w/2), generators[i])` in the pipeline dtype,
        flattened as the pipeline's `_pack_latents`."""
        self.check_shape(shape)
        channels = self.transformer.config.in_channels
        th, tw = self._token_hw(shape)
        draws = [
            randn_tensor((1, channels, th, tw), generator=g, device=self.device, dtype=self.dtype) for g in generators
        ]
        return torch.cat([self.pipe._pack_latents(d) for d in draws]).to(torch.float32)

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
        """Velocity (B, T, 4C) fp32 at per-sample sigmas (B,). With `negative` (klein base, guidance > 1) cond and
        uncond go through one forward and combine as `uncond + g (cond - uncond)`; dev gets `guidance_scale` through
        its guidance embedding."""
        batch = latents.shape[0]
        # As the pipeline: scheduler.timesteps (fp32 sigma * 1000) cast to the latents dtype, then / 1000.
        timestep = sigma.to(self.device, torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        timestep = timestep.to(self.dtype) / 1000
        prompt_embeds = encoding["prompt_embeds"].to(self.device, self.dtype)
        x = latents.to(self.device, self.dtype)
        cfg = negative is not None
        if cfg:
            prompt_embeds = torch.cat([prompt_embeds, negative["prompt_embeds"].to(self.device, self.dtype)])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        guidance = None
        if self.guidance_distilled:
            guidance = torch.full((x.shape[0],), guidance_scale, device=self.device, dtype=torch.float32)
        th, tw = self._token_hw(shape)
        img_ids = self.pipe._prepare_latent_ids(x.new_empty(x.shape[0], 1, th, tw)).to(self.device)
        txt_ids = self.pipe._prepare_text_ids(prompt_embeds).to(self.device)
        out = self.transformer(
            hidden_states=x,
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        if cfg:
            cond, uncond = out[:batch], out[batch:]
            out = uncond + guidance_scale * (cond - uncond)
        return out.to(torch.float32)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8: tokens to the patchified grid, batch-norm un-normalise, unpatchify, VAE decode,
        postprocess as the pipeline's "np"."""
        vae = self.pipe.vae
        th, tw = self._token_hw(shape)
        x = latents.to(self.device, vae.dtype)
        # `_unpack_latents_with_ids` scatters by the row-major position ids: the inverse of the row-major flatten.
        x = x.reshape(x.shape[0], th, tw, x.shape[-1]).permute(0, 3, 1, 2)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(x.device, x.dtype)
        x = self.pipe._unpatchify_latents(x * std + mean)
        images = vae.decode(x, return_dict=False)[0]
        return images_to_uint8(self.pipe.image_processor.postprocess(images, output_type="pt"))
