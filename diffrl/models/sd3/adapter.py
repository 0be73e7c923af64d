"""Stable Diffusion 3 / 3.5 (diffusers `StableDiffusion3Pipeline`) as a diffrl model adapter.

Mirrors diffusers 0.42.1 `pipeline_stable_diffusion_3.py` at noise level 0:
- prompts: CLIP-L and CLIP-G penultimate hidden states (77 tokens, concatenated on the feature dim and
  zero-padded to T5's width) followed by T5's last hidden state (`max_sequence_length` tokens, default
  256); pooled = concat of both CLIP projections. The pipeline's own `encode_prompt` computes them.
- sigmas: FlowMatchEulerDiscreteScheduler.set_timesteps (static shift, or `mu` from the image sequence
  length when the scheduler uses dynamic shifting); the transformer sees timestep = sigma * 1000.
- guidance: classic CFG, uncond and cond in ONE batched forward ([negative, positive], as upstream).
Not supported (not needed by the RL recipes): skip-layer guidance, IP-adapter, clip_skip, prompt_2/_3.

Legend: B batch, C latent channels (16), h, w latent height/width (image size / 8), L text tokens,
D joint_attention_dim, P pooled dim.
"""

from __future__ import annotations

import copy
import warnings

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import (
    Encoding,
    ModelAdapter,
    SampleShape,
    images_to_uint8,
    load_pipeline,
    register_adapter,
)


def warn_if_truncated(prompts: list[str], tokenizer, limit: int, what: str) -> None:
    """warnings.warn for each prompt whose token count (with special tokens) exceeds `limit`: the
    upstream pipeline truncates it to `limit` tokens, and so do we."""
    for i, prompt in enumerate(prompts):
        n = len(tokenizer(prompt).input_ids)
        if n > limit:
            warnings.warn(
                f"prompt {i} has {n} {what} tokens, more than the limit of {limit}; it is truncated "
                f"to {limit} tokens as the upstream pipeline does (prompt starts {prompt[:40]!r})",
                stacklevel=4,
            )  # the caller of encode_prompt (past torch.no_grad)


@register_adapter
class SD3Adapter(ModelAdapter):
    """SD3 / SD3.5 (Medium, Large, Large-Turbo): three text encoders, MMDiT transformer, classic CFG."""

    arch = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    # flow_grpo's SD3 LoRA targets (the joint attention; "attn." excludes SD3.5's attn2 self-attention).
    default_lora_targets = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )
    default_guidance_scale = 4.5
    default_max_sequence_length = 256  # the pipeline's default T5 length

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "SD3Adapter":
        """Load a StableDiffusion3Pipeline folder (ValueError naming the path when it is missing)."""
        if kwargs:
            raise ValueError(f"SD3Adapter.from_pretrained got unknown arguments {sorted(kwargs)}; it takes none")
        adapter = cls(
            load_pipeline(StableDiffusion3Pipeline, path, device=device, dtype=dtype), device=device, dtype=dtype
        )
        adapter.source = path
        return adapter

    @property
    def _multiple(self) -> int:
        return self.pipe.vae_scale_factor * self.pipe.patch_size

    def check_shape(self, shape: SampleShape) -> None:
        if shape.num_frames != 1:
            raise ValueError(f"num_frames must be 1 for the image model SD3, got {shape.num_frames}")
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % self._multiple:
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {self._multiple} (VAE scale "
                    f"factor {self.pipe.vae_scale_factor} x patch size {self.pipe.patch_size})"
                )

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, 77 + max_sequence_length, D), "pooled_prompt_embeds": (B, P)} exactly as
        the pipeline's `encode_prompt` (which this calls), in self.dtype on self.device."""
        length = max_sequence_length or self.default_max_sequence_length
        if not 0 < length <= 512:
            raise ValueError(f"max_sequence_length must be in [1, 512] for SD3 (T5), got {length}")
        pipe = self.pipe
        warn_if_truncated(prompts, pipe.tokenizer, pipe.tokenizer_max_length, "CLIP")
        if pipe.text_encoder_3 is not None:
            warn_if_truncated(prompts, pipe.tokenizer_3, length, "T5")
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=length,
        )
        return {"prompt_embeds": prompt_embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}

    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32 sigmas of a copy of the pipeline's scheduler after the pipeline's set_timesteps."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        scheduler = copy.deepcopy(self.pipe.scheduler)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            # Same mu as the pipeline: image tokens after patchification.
            patch = self.transformer.config.patch_size
            seq_len = (shape.height // self.pipe.vae_scale_factor // patch) * (
                shape.width // self.pipe.vae_scale_factor // patch
            )
            kwargs["mu"] = calculate_shift(
                seq_len,
                scheduler.config.get("base_image_seq_len", 256),
                scheduler.config.get("max_image_seq_len", 4096),
                scheduler.config.get("base_shift", 0.5),
                scheduler.config.get("max_shift", 1.16),
            )
        retrieve_timesteps(scheduler, num_inference_steps, "cpu", **kwargs)
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, C, h, w) fp32: sample i is `randn_tensor((1, C, h, w), generators[i])` in the pipeline dtype,
        as `StableDiffusion3Pipeline.prepare_latents` draws it for a batch of one."""
        self.check_shape(shape)
        factor = self.pipe.vae_scale_factor
        one = (1, self.transformer.config.in_channels, shape.height // factor, shape.width // factor)
        draws = [randn_tensor(one, generator=g, device=self.device, dtype=self.dtype) for g in generators]
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
        """Guided velocity (B, C, h, w) fp32 at per-sample sigmas (B,).

        CFG: uncond + g * (cond - uncond), in the model dtype as upstream. Cond and uncond run in one
        batched forward when their text lengths match (always, unless they were encoded with different
        max_sequence_length: SD3 has no text mask, so then it runs two forwards instead of padding).
        """
        # The pipeline feeds scheduler.timesteps = fp32 sigmas * num_train_timesteps.
        timestep = sigma.to(self.device, torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        x = latents.to(self.dtype)
        if not self.needs_negative(guidance_scale):
            return self._forward(x, timestep, encoding).to(torch.float32)
        if negative is None:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a negative-prompt encoding for SD3")
        if negative["prompt_embeds"].shape[1] == encoding["prompt_embeds"].shape[1]:
            both = {k: torch.cat([negative[k], encoding[k]]) for k in encoding}
            uncond, cond = self._forward(torch.cat([x, x]), timestep.repeat(2), both).chunk(2)
        else:
            uncond, cond = self._forward(x, timestep, negative), self._forward(x, timestep, encoding)
        return (uncond + guidance_scale * (cond - uncond)).to(torch.float32)

    def _forward(self, x: torch.Tensor, timestep: torch.Tensor, encoding: Encoding) -> torch.Tensor:
        return self.transformer(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=encoding["prompt_embeds"].to(self.dtype),
            pooled_projections=encoding["pooled_prompt_embeds"].to(self.dtype),
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8: unscale/unshift, VAE decode, postprocess as the pipeline's "np" output."""
        vae = self.pipe.vae
        # the VAE's own dtype: the trainer may run the transformer in another one
        x = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(x, return_dict=False)[0]
        return images_to_uint8(self.pipe.image_processor.postprocess(images, output_type="pt"))
