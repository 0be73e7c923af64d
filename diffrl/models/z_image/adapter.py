"""Z-Image adapter: mirrors diffusers' `ZImagePipeline` (text-to-image) at noise level 0.

Upstream details reproduced here (diffusers 0.42 `pipelines/z_image/pipeline_z_image.py`):
- each prompt is wrapped by the tokenizer's chat template (one user turn, generation prompt,
  enable_thinking=True), padded to `max_sequence_length` (512), and encoded by Qwen3; the
  second-to-last hidden layer is kept for the non-padded tokens: one (T_i, D) tensor per prompt;
- latents are (B, C, H/8, W/8) fp32 noise (unpacked; the transformer patchifies internally);
- sigmas = linspace(1, 1/N, N) through the scheduler (static shift; `mu` is passed as upstream does);
- the transformer gets the *reversed* time (1000 - t) / 1000 with t = sigma * 1000, and its output is
  negated before the Euler step (it predicts x0 - noise, the scheduler wants noise - x0);
- CFG is active when guidance_scale > 0 (not > 1): pred = cond + s (cond - uncond), a missing negative
  prompt meaning "" (the rollout engine encodes its `negative_prompt`, "" by default). The pipeline's
  `cfg_truncation` (CFG off where (1000 - t)/1000 > value) and `cfg_normalization` (cap |pred| at
  value x |cond|, per sample) are adapter options with the pipeline's defaults (1.0: never truncates;
  0/False: off).

The transformer takes lists of per-sample tensors; our Encoding stays batch-first (embeddings padded to
the batch's longest prompt + a bool mask) and the lists are rebuilt inside velocity(). Cond and uncond
go through one forward, as upstream (the transformer pads and masks per sample itself).

Legend: B batch, C latent channels, H/W latent height/width, T text tokens, D text hidden size.
"""

from __future__ import annotations

import copy
import warnings
from typing import ClassVar

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import (
    calculate_shift,
    get_default_z_image_sigmas,
    retrieve_timesteps,
)
from diffusers.utils.torch_utils import randn_tensor

from diffrl.models.base import (
    Encoding,
    ModelAdapter,
    SampleShape,
    images_to_uint8,
    load_pipeline,
    pad_and_cat,
    register_adapter,
)


@register_adapter
class ZImageAdapter(ModelAdapter):
    """Z-Image (single-stream S3-DiT, Qwen3 text encoder, FLUX-style AutoencoderKL)."""

    arch: ClassVar[str] = "z_image"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("ZImagePipeline",)
    # Attention and SwiGLU feed-forward projections of every block (main layers and both refiners),
    # the Z-Image counterpart of the Qwen-Image recipe's attention + MLP targets.
    default_lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3")
    default_guidance_scale: ClassVar[float] = 5.0  # upstream `guidance_scale` default
    default_max_sequence_length: ClassVar[int] = 512

    def __init__(
        self, pipe, *, device="cpu", dtype=torch.float32, cfg_normalization: float = 0.0, cfg_truncation: float = 1.0
    ):
        super().__init__(pipe, device=device, dtype=dtype)
        if cfg_normalization < 0:
            raise ValueError(f"cfg_normalization={cfg_normalization} must be >= 0 (0 disables it, as upstream False)")
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device="cpu",
        dtype=torch.float32,
        cfg_normalization: float = 0.0,
        cfg_truncation: float = 1.0,
        **kwargs,
    ) -> "ZImageAdapter":
        """Load a ZImagePipeline folder with `dtype` on `device`; CFG options as ZImagePipeline.__call__."""
        if kwargs:
            raise ValueError(
                f"unexpected options for z_image: {sorted(kwargs)}; allowed: cfg_normalization, cfg_truncation"
            )
        pipe = load_pipeline(ZImagePipeline, path, device=device, dtype=dtype)
        adapter = cls(
            pipe, device=device, dtype=dtype, cfg_normalization=cfg_normalization, cfg_truncation=cfg_truncation
        )
        adapter.source = path
        return adapter

    def fsdp_wrap_units(self) -> list[torch.nn.Module]:
        """Main layers and both refiners (Z-Image has no `transformer_blocks`)."""
        t = self.transformer
        return [*t.noise_refiner, *t.context_refiner, *t.layers]

    # ---- geometry --------------------------------------------------------------------------------
    @property
    def _multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2  # VAE factor x transformer patch size 2

    def check_shape(self, shape: SampleShape) -> None:
        """height and width must be multiples of VAE factor x patch size (16 for Z-Image); images only."""
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % self._multiple != 0:
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {self._multiple} "
                    f"(VAE scale factor {self.pipe.vae_scale_factor} x patch size 2) for Z-Image"
                )
        if shape.num_frames != 1:
            raise ValueError(f"num_frames={shape.num_frames}: Z-Image generates images, num_frames must be 1")

    def _latent_hw(self, shape: SampleShape) -> tuple[int, int]:
        return 2 * (shape.height // self._multiple), 2 * (shape.width // self._multiple)

    # ---- text ------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"prompt_embeds": (B, T, D) self.dtype, "prompt_embeds_mask": (B, T) bool}: row i holds
        upstream's i-th variable-length embedding in its first mask.sum() positions, zeros after."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if max_len < 1:
            raise ValueError(f"max_sequence_length={max_len} must be >= 1")
        tokenizer = self.pipe.tokenizer
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for p in prompts
        ]
        for prompt, text in zip(prompts, texts):
            n_tokens = len(tokenizer(text).input_ids)
            if n_tokens > max_len:
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {n_tokens} tokens with the chat template, more than "
                    f"max_sequence_length={max_len}: it is truncated to {max_len} tokens "
                    "(as ZImagePipeline does)",
                    stacklevel=3,
                )  # the caller (past no_grad)
        tokens = tokenizer(texts, padding="max_length", max_length=max_len, truncation=True, return_tensors="pt")
        input_ids, keep = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device).bool()
        hidden_BTD = self.pipe.text_encoder(
            input_ids=input_ids, attention_mask=keep, output_hidden_states=True
        ).hidden_states[-2]
        per_prompt = [
            {"prompt_embeds": h[m][None], "prompt_embeds_mask": m.new_ones(1, int(m.sum()))}
            for h, m in zip(hidden_BTD, keep)
        ]
        out = pad_and_cat(per_prompt)
        return {"prompt_embeds": out["prompt_embeds"].to(self.dtype), "prompt_embeds_mask": out["prompt_embeds_mask"]}

    def needs_negative(self, guidance_scale: float) -> bool:
        """Upstream runs CFG whenever guidance_scale > 0 (its negative prompt defaults to "")."""
        return guidance_scale > 0

    # ---- schedule and noise ----------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: the scheduler's sigmas after the pipeline's own `retrieve_timesteps` call."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.check_shape(shape)
        h, w = self._latent_hw(shape)
        config = self.pipe.scheduler.config
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler = copy.deepcopy(self.pipe.scheduler)  # set_timesteps mutates it
        retrieve_timesteps(
            scheduler, num_inference_steps, "cpu", sigmas=get_default_z_image_sigmas(num_inference_steps), mu=mu
        )
        return scheduler.sigmas.to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """Noise (B, C, H/8, W/8) fp32 (upstream draws fp32 whatever the model dtype)."""
        self.check_shape(shape)
        h, w = self._latent_hw(shape)
        channels = self.transformer.in_channels
        return torch.cat(
            [
                randn_tensor((1, channels, h, w), generator=g, device=self.device, dtype=torch.float32)
                for g in generators
            ]
        )

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
        """Guided flow velocity (B, C, H, W) fp32, sign-flipped as upstream; cond and uncond in one forward."""
        batch = latents.shape[0]
        t_B = sigma.to(device=self.device, dtype=torch.float32) * 1000  # scheduler.timesteps
        scale_B = self._guidance_per_sample(t_B, guidance_scale)
        apply_cfg = bool((scale_B > 0).any())
        if apply_cfg and negative is None:
            raise ValueError(
                f"guidance_scale={guidance_scale} > 0 needs a negative encoding for Z-Image "
                "(upstream uses the negative prompt, default \"\"); pass encode_prompt([''] * B)"
            )
        x_BCHW = latents.to(device=self.device, dtype=self.dtype)
        text = pad_and_cat([encoding, negative]) if apply_cfg else encoding
        if apply_cfg:
            x_BCHW, t_B = torch.cat([x_BCHW, x_BCHW]), torch.cat([t_B, t_B])
        caption_list = [e[m.bool()] for e, m in zip(text["prompt_embeds"].to(self.dtype), text["prompt_embeds_mask"])]
        out_list = self.transformer(
            list(x_BCHW.unsqueeze(2).unbind(0)), (1000 - t_B) / 1000, caption_list, return_dict=False
        )[0]
        out = torch.stack([o.float() for o in out_list]).squeeze(2)
        pred = out[:batch]
        if apply_cfg:
            pred = z_image_cfg(out[:batch], out[batch:], scale_B, self.cfg_normalization)
        return -pred  # the transformer predicts x0 - noise; the flow-matching step takes noise - x0

    def _guidance_per_sample(self, t_B: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """(B,) CFG scale per sample: guidance_scale, or 0 where upstream's cfg_truncation switches CFG off."""
        scale_B = torch.full_like(t_B, float(guidance_scale))
        if guidance_scale > 0 and self.cfg_truncation <= 1:
            scale_B = torch.where((1000 - t_B) / 1000 > self.cfg_truncation, torch.zeros_like(scale_B), scale_B)
        return scale_B

    # ---- pixels ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8, equal to the pipeline's output_type="np" images x 255, rounded."""
        vae = self.pipe.vae
        z = latents.to(device=self.device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return images_to_uint8(self.pipe.image_processor.postprocess(image, output_type="pt"))


def z_image_cfg(
    cond: torch.Tensor, uncond: torch.Tensor, scale_B: torch.Tensor, cfg_normalization: float
) -> torch.Tensor:
    """Z-Image CFG in fp32: cond + s (cond - uncond) per sample; with cfg_normalization > 0 the result's
    norm (over the whole sample) is capped at cfg_normalization x |cond|, as ZImagePipeline does."""
    shape = (-1,) + (1,) * (cond.dim() - 1)
    pred = cond + scale_B.view(shape) * (cond - uncond)
    if cfg_normalization > 0:
        cond_norm = torch.linalg.vector_norm(cond.flatten(1), dim=1)
        pred_norm = torch.linalg.vector_norm(pred.flatten(1), dim=1)
        max_norm = cond_norm * cfg_normalization
        # Upstream renormalises only where CFG ran (a truncated step returns cond untouched).
        capped = (pred_norm > max_norm) & (scale_B > 0)
        factor = torch.where(capped, max_norm / pred_norm, torch.ones_like(pred_norm))
        pred = pred * factor.view(shape)
    return pred
