"""Qwen-Image-2.1 adapter: mirrors diffusers' `QwenImage21Pipeline` (text-to-image) at noise level 0.

Qwen-Image-2.1 shares little with Qwen-Image beyond the name: a Qwen3-VL text encoder read through its processor, a
single-stream block-causal transformer over one joint text + image sequence, an RGBA VAE with 16x compression and 64
latent channels consumed unpatched, plain CFG, and no guidance by default. Upstream details reproduced here
(diffusers 0.42 `pipelines/qwenimage21/pipeline_qwenimage21.py`):
- prompts (an empty one becomes " ") go into the raw t2i template `prompt_template_t2i`, tokenized by the folder's
  processor with left padding; the text encoder's last decoder layer is read *before* its final RMSNorm (upstream
  hooks the norm into an identity for the call), the non-padded tokens of each prompt are kept and the first
  `_drop_idx` tokens (the system message as the processor's chat template renders it) dropped;
- noise is drawn as (B, 1, C, H/16, W/16) in the pipeline dtype and flattened to (B, L, C) tokens;
- sigmas are the folder's `sample_sigmas` when it ships them (their length is then the number of steps), else
  linspace(1, 1/N, N), shifted by the scheduler with `mu = calculate_shift(L)`;
- the transformer gets `timestep = t / 1000` (t = sigma * 1000 cast to the latents dtype), the text followed by
  L / 4 image slots (`img_mask`), and returns the joint sequence: the velocity is its last L tokens;
- CFG (guidance_scale > 1 and a negative prompt) is plain `neg + s (cond - neg)`, no norm rescale;
- decoding: `latents * latents_std + latents_mean`, the VAE gives RGBA in [-1, 1].

Deviations:
- The transformer's RoPE advances the image's frame position past every text slot, padding included, so a prompt
  padded to a longer one in a batch gives another image (upstream's own batch test allows 2e-3 for this). Here rows
  run in one forward per text length, without padding, so a sample equals upstream called with its prompt alone;
  cond and uncond rows of one length share a forward.
- Every step recomputes the text's keys and values (upstream caches them after the first step, `use_kv_cache`,
  valid because text tokens are modulated at t = 0); same values, more compute, and LoRA on the text path trains.
- `decode` returns RGB: the RGBA output composited over white, as upstream flattens RGBA images for its vision
  encoder (`output_type="np"` gives 4 channels).
- Prompts longer than `max_sequence_length` (default 1024) are cut to that many tokens with a warning; upstream has
  no limit.

Legend: B batch, L image tokens (one per 16x16 pixel tile), T text tokens, D text hidden size, C latent channels.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import ClassVar

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

from diffrl.models.base import Encoding, ModelAdapter, SampleShape, images_to_uint8, load_pipeline, register_adapter

_SLOT_TOKENS = 4  # each image slot of the text encoder's sequence stands for 2x2 latent tokens


# Adapted from diffrl/models/qwen_image/adapter_edit.py: ImageOnlyQwen2VLProcessor, load_processor
class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without its video processor (whose base class needs torchvision); text and images as
    upstream's processor renders them."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: str) -> ImageOnlyQwen3VLProcessor:
    """The `processor/` component of a Qwen-Image-2.1 folder: its tokenizer, image processor and chat template."""
    sub = os.path.join(folder, "processor")
    if not os.path.isdir(sub):
        raise ValueError(f"{folder!r} has no processor/ folder: not a QwenImage21Pipeline folder")
    tokenizer = AutoTokenizer.from_pretrained(sub)
    return ImageOnlyQwen3VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(sub),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


@register_adapter
class QwenImage21Adapter(ModelAdapter):
    """Qwen-Image-2.1 (single-stream block-causal DiT, Qwen3-VL text encoder, 16x RGBA VAE with 64 channels)."""

    arch: ClassVar[str] = "qwen_image21"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImage21Pipeline",)
    # Every projection of the single-stream blocks: attention q/k/v/out and the SwiGLU MLP.
    default_lora_targets: ClassVar[tuple[str, ...]] = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "img_mlp.proj",
        "img_mlp.gate_layer",
        "img_mlp.out",
    )
    default_guidance_scale: ClassVar[float] = 1.0  # upstream `true_cfg_scale` default: sampled without guidance
    default_max_sequence_length: ClassVar[int] = 1024

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **kwargs) -> "QwenImage21Adapter":
        """Load a QwenImage21Pipeline folder with `torch_dtype=dtype` and move it to `device`."""
        if kwargs:
            raise ValueError(f"unexpected options for qwen_image21: {sorted(kwargs)}; it takes none")
        folder = path.removeprefix("random:")
        extra = {"processor": load_processor(folder)} if os.path.isdir(folder) else None
        pipe = load_pipeline(QwenImage21Pipeline, path, device=device, dtype=dtype, components=extra)
        adapter = cls(pipe, device=device, dtype=dtype)
        adapter.source = path
        return adapter

    # ---- geometry --------------------------------------------------------------------------------
    # Adapted from diffrl/models/qwen_image/adapter.py: _multiple, _token_grid, check_shape
    @property
    def _multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # one text-encoder image slot covers 2x2 latent tokens

    def _token_grid(self, shape: SampleShape) -> tuple[int, int]:
        """(rows, cols) of latent tokens for an image size."""
        return shape.height // self.pipe.vae_scale_factor, shape.width // self.pipe.vae_scale_factor

    def check_shape(self, shape: SampleShape) -> None:
        """height and width must be multiples of 32 (VAE factor 16 x the 2x2 slot); images only."""
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % self._multiple != 0:
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {self._multiple} "
                    f"(VAE scale factor {self.pipe.vae_scale_factor} x 2) for Qwen-Image-2.1"
                )
        if shape.num_frames != 1:
            raise ValueError(f"num_frames={shape.num_frames}: Qwen-Image-2.1 generates images, num_frames must be 1")

    # ---- text ------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, T, D) self.dtype, "prompt_embeds_mask": (B, T) int64} as upstream's
        `_get_qwen_prompt_embeds` for text-to-image (right-padded to the batch's longest, mask always returned)."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if max_len < 1:
            raise ValueError(f"max_sequence_length={max_len} must be >= 1")
        pipe = self.pipe
        texts = [pipe.prompt_template_t2i.format(p or " ") for p in prompts]  # upstream: "" has nothing to read
        inputs = pipe.processor(text=texts, padding=True, padding_side="left", return_tensors="pt").to(self.device)
        forward = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
        if "mm_token_type_ids" in inputs:
            forward["mm_token_type_ids"] = inputs.mm_token_type_ids
        hidden_BTD = self._pre_norm_last_hidden(forward)
        keep = inputs.attention_mask.bool()
        per_prompt = [h[m][pipe._drop_idx :] for h, m in zip(hidden_BTD, keep)]
        for prompt, e in zip(prompts, per_prompt):
            if e.shape[0] > max_len:
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {e.shape[0]} tokens, more than max_sequence_length={max_len}: "
                    f"it is truncated to {max_len} tokens (QwenImage21Pipeline does not truncate)",
                    stacklevel=3,
                )
        per_prompt = [e[:max_len] for e in per_prompt]
        longest = max(e.shape[0] for e in per_prompt)
        embeds = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in per_prompt])
        mask = torch.stack([torch.arange(longest, device=self.device) < e.shape[0] for e in per_prompt]).long()
        return {"prompt_embeds": embeds.to(self.dtype), "prompt_embeds_mask": mask}

    def _pre_norm_last_hidden(self, forward: dict) -> torch.Tensor:
        """(B, T, D): the text encoder's last decoder layer output before its final RMSNorm, which the transformer
        was trained on (transformers >= 5 returns the normed one as hidden_states[-1]): the norm is made an identity
        for this call by a forward hook returning its input, as upstream does."""
        encoder = self.pipe.text_encoder
        text_model = getattr(encoder.model, "language_model", encoder.model)
        handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
        try:
            return encoder(**forward, output_hidden_states=True).hidden_states[-1]
        finally:
            handle.remove()

    # ---- schedule and noise ----------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: the scheduler's sigmas after the pipeline's own `retrieve_timesteps` call."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.check_shape(shape)
        shipped = self.pipe.config.get("sample_sigmas")
        if shipped is not None and len(shipped) != num_inference_steps:
            raise ValueError(
                f"num_inference_steps={num_inference_steps}: this folder's model_index.json fixes the schedule "
                f"(sample_sigmas, {len(shipped)} steps); set num_inference_steps={len(shipped)} or remove sample_sigmas"
            )
        base = shipped if shipped is not None else np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
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
        retrieve_timesteps(scheduler, num_inference_steps, "cpu", sigmas=base, mu=mu)
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """Token latents (B, L, C) fp32; sample i is what upstream draws for one image with generators[i]."""
        self.check_shape(shape)
        rows, cols = self._token_grid(shape)
        channels = self.pipe.transformer.config.in_channels
        samples = []
        for generator in generators:
            noise = randn_tensor(
                (1, 1, channels, rows, cols), generator=generator, device=self.device, dtype=self.dtype
            )
            samples.append(QwenImage21Pipeline._pack_latents(noise, 1, channels, rows, cols))
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
        """Guided flow velocity (B, L, C) fp32. CFG when guidance_scale > 1 and a negative encoding is given, as
        upstream; one forward per text length (cond and uncond rows of one length together), none padded."""
        batch = latents.shape[0]
        # Upstream: t = sigma * 1000 (scheduler.timesteps, fp32), cast to the latents dtype, then / 1000.
        timestep_B = (sigma.to(device=self.device, dtype=torch.float32) * 1000).to(self.dtype) / 1000
        hidden = latents.to(device=self.device, dtype=self.dtype)
        texts = [encoding, negative] if guidance_scale > 1 and negative is not None else [encoding]
        embeds = [e["prompt_embeds"][i, : int(e["prompt_embeds_mask"][i].sum())] for e in texts for i in range(batch)]
        rows_hidden, rows_t = torch.cat([hidden] * len(texts)), torch.cat([timestep_B] * len(texts))
        pred = torch.empty_like(rows_hidden)
        by_length: dict[int, list[int]] = {}
        for row, e in enumerate(embeds):
            by_length.setdefault(e.shape[0], []).append(row)
        for length, rows in by_length.items():
            index = torch.tensor(rows, device=self.device)
            text = torch.stack([embeds[r] for r in rows]).to(self.dtype)
            pred[index] = self._forward(rows_hidden[index], rows_t[index], text, shape)
        if len(texts) == 2:
            cond, uncond = pred[:batch], pred[batch:]
            pred = uncond + guidance_scale * (cond - uncond)
        return pred.to(torch.float32)

    def _forward(self, hidden_BLC, timestep_B, text_BTD, shape: SampleShape) -> torch.Tensor:
        """The transformer on rows sharing one unpadded text length; (B, L, C), the target image's tokens."""
        rows, cols = self._token_grid(shape)
        batch, tokens = hidden_BLC.shape[0], rows * cols
        slots = hidden_BLC.new_zeros(batch, text_BTD.shape[1] + tokens // _SLOT_TOKENS, dtype=torch.bool)
        slots[:, text_BTD.shape[1] :] = True  # the target image's slots follow the text
        out = self.transformer(
            hidden_states=hidden_BLC,
            timestep=timestep_B,
            encoder_hidden_states=text_BTD,
            encoder_hidden_states_mask=None,  # upstream passes None when nothing is padded
            img_shapes=[[(1, rows, cols)]] * batch,
            img_mask=slots,
            return_dict=False,
        )[0]
        return out[:, -tokens:]

    # ---- pixels ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8: upstream's RGBA output_type="np" image composited over white, x 255, rounded."""
        vae = self.pipe.vae
        z = QwenImage21Pipeline._unpack_latents(
            latents.to(self.device), shape.height, shape.width, self.pipe.vae_scale_factor
        ).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return images_to_uint8(over_white(self.pipe.image_processor.postprocess(image, output_type="pt")))


def over_white(images_B4HW: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1]: RGBA in [0, 1] composited over a white background (RGB passes through)."""
    if images_B4HW.shape[1] == 3:
        return images_B4HW
    rgb, alpha = images_B4HW[:, :3], images_B4HW[:, 3:4]
    return rgb * alpha + (1 - alpha)
