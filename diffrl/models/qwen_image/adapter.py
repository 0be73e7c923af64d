"""Qwen-Image adapter: mirrors diffusers' `QwenImagePipeline` (text-to-image) at noise level 0.

Upstream details reproduced here (diffusers 0.42 `pipelines/qwenimage/pipeline_qwenimage.py`):
- prompts go through a fixed system/user chat template; the last hidden layer of Qwen2.5-VL is kept
  for the non-padded tokens, the first 34 (template) tokens are dropped whatever the tokenizer, the
  rest is right-padded to the batch's longest and cut to `max_sequence_length` (default 512);
- latents are drawn as (B, 1, C, H/8, W/8) and packed into 2x2 patches: (B, L, C*4);
- sigmas = linspace(1, 1/N, N) shifted by the scheduler with `mu = calculate_shift(L)`;
- the transformer gets `timestep = t / 1000` where t = sigma * 1000 as the scheduler stores it;
- "true CFG" (guidance_scale > 1 and a negative prompt): comb = neg + s (cond - neg), then rescaled
  to the conditional prediction's norm along the channel dim: out = comb * |cond| / |comb|.

Deviation: upstream passes `encoder_hidden_states_mask=None` when a batch has no padding; we always
pass the mask (all ones then), which the attention treats identically. Cond and uncond run in one
forward with text padded to a common length: the joint attention masks padded text keys and text RoPE
positions do not depend on the padding, so this equals two forwards (tests/models/test_qwen_image.py).

Legend: B batch, L image tokens (packed 2x2 patches), T text tokens, D text hidden size,
C latent channels (VAE z_dim).
"""

from __future__ import annotations

import copy
import warnings
from typing import ClassVar

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import (
    Encoding,
    ModelAdapter,
    SampleShape,
    images_to_uint8,
    load_pipeline,
    pad_and_cat,
    pad_tokens,
    register_adapter,
    text_bucket,
)

TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask")  # an encoding's entries with a token dim
# QwenImagePipeline.check_inputs refuses longer text; the tokenizer keeps at most this + the template.
_MAX_SEQUENCE_LENGTH_LIMIT = 1024


@register_adapter
class QwenImageAdapter(ModelAdapter):
    """Qwen-Image (20B MMDiT, Qwen2.5-VL text encoder, 3D-causal VAE used on single frames)."""

    arch: ClassVar[str] = "qwen_image"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImagePipeline",)
    # VeRL-Omni's Qwen-Image LoRA recipe: all attention and MLP projections of both streams.
    default_lora_targets: ClassVar[tuple[str, ...]] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    default_guidance_scale: ClassVar[float] = 4.0  # upstream `true_cfg_scale` default
    default_max_sequence_length: ClassVar[int] = 512

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "QwenImageAdapter":
        """Load a QwenImagePipeline folder with `torch_dtype=dtype` and move it to `device`."""
        if kwargs:
            raise ValueError(f"unexpected options for qwen_image: {sorted(kwargs)}; it takes none")
        pipe = load_pipeline(QwenImagePipeline, path, device=device, dtype=dtype)
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(
                f"{path!r}: guidance-distilled Qwen-Image transformers (guidance_embeds=True) "
                "are not supported; use a model with true CFG"
            )
        adapter = cls(pipe, device=device, dtype=dtype)
        adapter.source = path
        return adapter

    # ---- geometry --------------------------------------------------------------------------------
    @property
    def _multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # VAE factor x 2x2 packing

    def _token_grid(self, shape: SampleShape) -> tuple[int, int]:
        """(rows, cols) of packed latent tokens for an image size."""
        return shape.height // self._multiple, shape.width // self._multiple

    def check_shape(self, shape: SampleShape) -> None:
        """height and width must be multiples of VAE factor x patch size (16 for Qwen-Image); images only."""
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % self._multiple != 0:
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {self._multiple} "
                    f"(VAE scale factor {self.pipe.vae_scale_factor} x patch size 2) for Qwen-Image"
                )
        if shape.num_frames != 1:
            raise ValueError(f"num_frames={shape.num_frames}: Qwen-Image generates images, num_frames must be 1")

    # ---- text ------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, T, D) self.dtype, "prompt_embeds_mask": (B, T) int64} as upstream
        `encode_prompt` (the mask is always returned, all ones when nothing is padded)."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if not 0 < max_len <= _MAX_SEQUENCE_LENGTH_LIMIT:
            raise ValueError(
                f"max_sequence_length={max_len} must be in [1, {_MAX_SEQUENCE_LENGTH_LIMIT}] for Qwen-Image"
            )
        pipe = self.pipe
        drop = pipe.prompt_template_encode_start_idx
        texts = [pipe.prompt_template_encode.format(p) for p in prompts]
        self._warn_if_truncated(prompts, texts, drop, max_len)
        tokens = pipe.tokenizer(
            texts, max_length=pipe.tokenizer_max_length + drop, padding=True, truncation=True, return_tensors="pt"
        ).to(self.device)
        hidden_BTD = pipe.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        ).hidden_states[-1]
        keep = tokens.attention_mask.bool()
        # Non-padded tokens of each prompt, minus the template's fixed-length prefix (upstream drop_idx).
        per_prompt = [h[m][drop:] for h, m in zip(hidden_BTD, keep)]
        longest = max(e.shape[0] for e in per_prompt)
        embeds = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in per_prompt])
        mask = torch.stack([torch.arange(longest, device=self.device) < e.shape[0] for e in per_prompt]).long()
        return {"prompt_embeds": embeds[:, :max_len].to(self.dtype), "prompt_embeds_mask": mask[:, :max_len]}

    def _warn_if_truncated(self, prompts: list[str], texts: list[str], drop: int, max_len: int) -> None:
        for prompt, text in zip(prompts, texts):
            n_tokens = len(self.pipe.tokenizer(text).input_ids) - drop
            if n_tokens > max_len:
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {n_tokens} tokens, more than max_sequence_length="
                    f"{max_len}: it is truncated to {max_len} tokens (as QwenImagePipeline does)",
                    stacklevel=4,
                )  # the caller of encode_prompt (past no_grad)

    # ---- schedule and noise ----------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: the scheduler's sigmas after the pipeline's own `retrieve_timesteps` call."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.check_shape(shape)
        rows, cols = self._token_grid(shape)
        config = self.pipe.scheduler.config
        mu = calculate_shift(
            rows * cols,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler = copy.deepcopy(self.pipe.scheduler)  # set_timesteps mutates it
        base = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        retrieve_timesteps(scheduler, num_inference_steps, "cpu", sigmas=base, mu=mu)
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """Packed noise (B, L, C*4) fp32; sample i is what upstream draws for one image with generators[i]."""
        self.check_shape(shape)
        rows, cols = self._token_grid(shape)
        channels = self.pipe.transformer.config.in_channels // 4
        samples = []
        for generator in generators:
            # Upstream draws (1, 1, C, 2*rows, 2*cols) in the pipeline dtype, then packs 2x2 patches.
            noise = randn_tensor(
                (1, 1, channels, 2 * rows, 2 * cols), generator=generator, device=self.device, dtype=self.dtype
            )
            samples.append(QwenImagePipeline._pack_latents(noise, 1, channels, 2 * rows, 2 * cols))
        return torch.cat(samples).to(torch.float32)

    # ---- denoiser --------------------------------------------------------------------------------
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
        """Guided flow velocity (B, L, C*4) fp32. True CFG (with norm rescale) when guidance_scale > 1 and
        a negative encoding is given, as upstream; cond and uncond share one batched forward."""
        batch = latents.shape[0]
        # Upstream: t = sigma * 1000 (scheduler.timesteps, fp32), cast to the latents dtype, then / 1000.
        timestep_B = (sigma.to(device=self.device, dtype=torch.float32) * 1000).to(self.dtype) / 1000
        hidden = latents.to(device=self.device, dtype=self.dtype)
        do_true_cfg = guidance_scale > 1 and negative is not None
        text = pad_and_cat([encoding, negative]) if do_true_cfg else encoding
        text = self._bucketed(text)
        if do_true_cfg:
            hidden, timestep_B = torch.cat([hidden, hidden]), torch.cat([timestep_B, timestep_B])
        rows, cols = self._token_grid(shape)
        pred = self.transformer(
            hidden_states=hidden,
            timestep=timestep_B,
            guidance=None,
            encoder_hidden_states=text["prompt_embeds"].to(self.dtype),
            encoder_hidden_states_mask=text["prompt_embeds_mask"],
            img_shapes=[[(1, rows, cols)]] * hidden.shape[0],
            return_dict=False,
        )[0]
        if do_true_cfg:
            pred = true_cfg(pred[:batch], pred[batch:], guidance_scale)
        return pred.to(torch.float32)

    def _bucketed(self, text: Encoding) -> Encoding:
        """Once the blocks are compiled, the text padded to its `text_bucket` length (padded tokens are masked out),
        so prompts of different lengths share a few static graphs; unchanged otherwise."""
        if not self.compiled:
            return text
        return pad_tokens(text, TEXT_KEYS, text_bucket(text["prompt_embeds"].shape[1]))

    # ---- pixels ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8, equal to the pipeline's output_type="np" images x 255, rounded."""
        vae = self.pipe.vae
        z = QwenImagePipeline._unpack_latents(
            latents.to(self.device), shape.height, shape.width, self.pipe.vae_scale_factor
        ).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        return images_to_uint8(self.pipe.image_processor.postprocess(image, output_type="pt"))


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Qwen-Image true CFG: neg + s (cond - neg), rescaled to cond's norm over the last (channel) dim."""
    comb = uncond + guidance_scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
