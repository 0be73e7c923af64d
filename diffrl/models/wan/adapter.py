"""Wan text-to-video (Wan2.1, and Wan2.2 with its two experts) as a diffrl model adapter.

Mirrors `diffusers.pipelines.wan.pipeline_wan.WanPipeline` (diffusers 0.42.1): UMT5 prompt
embeddings zero-padded to `max_sequence_length` (no attention mask reaches the transformer), video
latents (B, C, F', H', W') with F' = (num_frames - 1) // 4 + 1, timestep = sigma * num_train_timesteps,
CFG `uncond + g * (cond - uncond)`, and for Wan2.2 the high-noise expert `transformer` at timesteps
>= boundary_ratio * num_train_timesteps, the low-noise expert `transformer_2` (guided by
`guidance_scale_2`) below it.

Legend: B batch, C latent channels, F' latent frames, H'/W' latent height/width, L text tokens,
D text hidden size, F/H/W output frames/height/width.

Deviations from the upstream pipeline (documented, by design):
- Real Wan folders ship `UniPCMultistepScheduler`. Our sampler integrates flow-matching Euler
  (noise level 0) or SDE steps on the sigma schedule that scheduler produces (`sigmas()` reads it),
  so outputs equal upstream only when the folder's scheduler is `FlowMatchEulerDiscreteScheduler`
  (as in the tiny folders the parity tests use). UniPC also hands the transformer int64-truncated
  timesteps; we pass sigma * num_train_timesteps unrounded.
- Sizes the pipeline silently rounds (num_frames not 1 mod 4, height/width not a multiple of the
  VAE factor x patch size) are a ValueError here.
- Cond and uncond run in ONE batched forward (upstream runs two); equal up to fp rounding.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from diffrl.models.base import Encoding, ModelAdapter, SampleShape, load_pipeline, register_adapter


@register_adapter
class WanAdapter(ModelAdapter):
    """Wan2.1 / Wan2.2 text-to-video (`WanPipeline` folders, one or two denoising experts).

    `guidance_scale_2` (Wan2.2 only) is the CFG scale of the low-noise expert; None means "same as
    guidance_scale" exactly as upstream. Set it at load time or assign the attribute later.
    """

    arch = "wan"
    pipeline_classes = ("WanPipeline",)
    is_video = True
    # Self- and cross-attention projections (attn1/attn2) and the FFN of every WanTransformerBlock.
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    default_guidance_scale = 5.0  # WanPipeline.__call__ default
    default_max_sequence_length = 512  # WanPipeline.__call__ default (encode_prompt's own is 226)

    def __init__(
        self,
        pipe: WanPipeline,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        guidance_scale_2: float | None = None,
    ):
        super().__init__(pipe, device=device, dtype=dtype)
        if pipe.transformer is None:
            raise ValueError("this Wan folder has no `transformer` (high-noise expert); diffrl needs it")
        self.guidance_scale_2 = guidance_scale_2

    @property
    def guidance_scale_2(self) -> float | None:
        """CFG scale of the low-noise expert (Wan2.2); None = use the guidance_scale passed to velocity."""
        return self._guidance_scale_2

    @guidance_scale_2.setter
    def guidance_scale_2(self, value: float | None) -> None:
        if value is not None and self.boundary_ratio is None:
            raise ValueError(
                "guidance_scale_2 is only supported for two-expert Wan2.2 folders "
                "(model_index.json boundary_ratio set); leave it None for Wan2.1"
            )
        self._guidance_scale_2 = None if value is None else float(value)

    @classmethod
    def from_pretrained(
        cls, path: str, *, device="cpu", dtype=torch.float32, guidance_scale_2: float | None = None, **kwargs
    ) -> "WanAdapter":
        """Load a WanPipeline folder (download Hub checkpoints first: no network at run time).

        guidance_scale_2: the low-noise expert's CFG scale (Wan2.2 folders only); None = guidance_scale.
        """
        if kwargs:
            raise ValueError(
                f"WanAdapter.from_pretrained got unknown arguments {sorted(kwargs)}; it takes only guidance_scale_2"
            )
        pipe = load_pipeline(WanPipeline, path, device=device, dtype=dtype)
        adapter = cls(pipe, device=device, dtype=dtype, guidance_scale_2=guidance_scale_2)
        adapter.source = path
        return adapter

    # ---- structure -----------------------------------------------------------------------------
    @property
    def boundary_ratio(self) -> float | None:
        """Wan2.2 expert switch as a fraction of num_train_timesteps; None for Wan2.1."""
        return self.pipe.config.boundary_ratio

    def denoisers(self) -> list[nn.Module]:
        """The high-noise expert, plus the low-noise expert `transformer_2` where present."""
        return [m for m in (self.pipe.transformer, self.pipe.transformer_2) if m is not None]

    def fsdp_wrap_units(self) -> list[nn.Module]:
        """Every WanTransformerBlock (`blocks`) of every expert."""
        return [block for model in self.denoisers() for block in model.blocks]

    def _multiples(self) -> tuple[int, int]:
        # Upstream check_inputs hard-requires multiples of 16; patchification needs VAE factor x patch.
        patch = self.transformer.config.patch_size
        spatial = self.pipe.vae_scale_factor_spatial
        return math.lcm(16, spatial * patch[1]), math.lcm(16, spatial * patch[2])

    # ---- the sampling contract -----------------------------------------------------------------
    def check_shape(self, shape: SampleShape) -> None:
        """height/width multiples of lcm(16, VAE factor x patch); num_frames = 1 mod the VAE's temporal factor."""
        h_multiple, w_multiple = self._multiples()
        if shape.height <= 0 or shape.height % h_multiple:
            raise ValueError(
                f"height={shape.height} must be a positive multiple of {h_multiple} "
                f"(VAE scale factor x transformer patch size) for Wan"
            )
        if shape.width <= 0 or shape.width % w_multiple:
            raise ValueError(
                f"width={shape.width} must be a positive multiple of {w_multiple} "
                f"(VAE scale factor x transformer patch size) for Wan"
            )
        temporal = self.pipe.vae_scale_factor_temporal
        if shape.num_frames < 1 or (shape.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames={shape.num_frames} must be k * {temporal} + 1 (e.g. 1, 5, 9, ..., 81) "
                f"for Wan's temporal VAE factor {temporal}"
            )

    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """UMT5 last hidden state, cut at each prompt's length and zero-padded to max_sequence_length,
        as `WanPipeline._get_t5_prompt_embeds`. Returns {"prompt_embeds": (B, L, D)}."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if max_len < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length} must be >= 1 (Wan's default is 512)")
        cleaned = [prompt_clean(p) for p in prompts]
        tokenizer = self.pipe.tokenizer
        for i, text in enumerate(cleaned):
            n_tokens = len(tokenizer(text, add_special_tokens=True).input_ids)
            if n_tokens > max_len:
                warnings.warn(
                    f"prompt {i} has {n_tokens} tokens, more than max_sequence_length={max_len}: "
                    f"truncated to {max_len} tokens (as the upstream Wan pipeline does)",
                    stacklevel=2,
                )
        text_inputs = tokenizer(
            cleaned,
            padding="max_length",
            max_length=max_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids_BL, mask_BL = text_inputs.input_ids, text_inputs.attention_mask
        seq_lens = mask_BL.gt(0).sum(dim=1).long()
        encoder = self.pipe.text_encoder
        with torch.no_grad():
            hidden_BLD = encoder(ids_BL.to(encoder.device), mask_BL.to(encoder.device)).last_hidden_state
        hidden_BLD = hidden_BLD.to(dtype=self.dtype, device=self.device)
        # Upstream keeps each prompt's real tokens and replaces the rest by zeros (not by the encoder's
        # outputs at pad positions); the transformer sees no mask, so the zeros matter.
        keep_BL1 = (torch.arange(max_len, device=self.device)[None, :] < seq_lens.to(self.device)[:, None])[..., None]
        return {"prompt_embeds": hidden_BLD * keep_BL1}

    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """The folder scheduler's sigmas after the pipeline's `set_timesteps(N)` (no resolution shift)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_inference_steps, device="cpu")
        sigmas = scheduler.sigmas.to(torch.float32)
        assert sigmas.shape == (num_inference_steps + 1,) and sigmas[-1] == 0, "scheduler must end at sigma 0"
        return sigmas

    def _latent_channels(self) -> int:
        """Channels of the denoised latents (WanPipeline draws the transformer's in_channels)."""
        return self.transformer.config.in_channels

    def _condition(self, encoding: Encoding) -> torch.Tensor | None:
        """Latents concatenated channel-wise to the noisy ones before each forward (image-to-video); none here."""
        return None

    def _latent_shape(self, shape: SampleShape) -> tuple[int, int, int, int]:
        spatial = self.pipe.vae_scale_factor_spatial
        num_latent_frames = (shape.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        return (self._latent_channels(), num_latent_frames, shape.height // spatial, shape.width // spatial)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, C, F', H', W') fp32 noise; sample i is upstream's draw for batch 1 with generators[i]."""
        self.check_shape(shape)
        one = (1, *self._latent_shape(shape))
        noise = [randn_tensor(one, generator=g, device=self.device, dtype=torch.float32) for g in generators]
        return torch.cat(noise, dim=0)

    def _expert_index(self, timesteps_B: torch.Tensor) -> torch.Tensor:
        """Wan2.2: 0 = high-noise `transformer`, 1 = low-noise `transformer_2`, per sample."""
        boundary = self.boundary_ratio * self.pipe.scheduler.config.num_train_timesteps
        # Same comparison as upstream `t >= boundary_timestep` on an fp32 timestep.
        return (timesteps_B < boundary).long()

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
        """Guided flow velocity (B, C, F', H', W') fp32; cond+uncond in one forward per expert.

        Samples whose timestep falls on different Wan2.2 experts are split into one forward per expert.
        CFG is on when guidance_scale > 1 (upstream's switch), the low-noise expert then uses
        `self.guidance_scale_2` (default: guidance_scale).
        """
        cfg = self.uses_cfg(guidance_scale, negative)
        timesteps_B = sigma.to(device=self.device, dtype=torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        timesteps_B = timesteps_B.expand(latents.shape[0])
        embeds_BLD, negative_BLD = encoding["prompt_embeds"], negative["prompt_embeds"] if cfg else None
        condition = self._condition(encoding)
        if self.boundary_ratio is None:  # Wan2.1: one expert, no routing
            return self._guided(
                self.pipe.transformer, latents, timesteps_B, embeds_BLD, negative_BLD, guidance_scale, condition
            )
        experts_B = self._expert_index(timesteps_B)
        scales = (guidance_scale, guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2)
        out = torch.zeros(latents.shape, dtype=torch.float32, device=self.device)
        for expert, model in enumerate((self.pipe.transformer, self.pipe.transformer_2)):
            rows = (experts_B == expert).nonzero().flatten()
            if rows.numel() == 0:
                continue
            neg = None if negative_BLD is None else negative_BLD[rows]
            cond = None if condition is None else condition[rows]
            v = self._guided(model, latents[rows], timesteps_B[rows], embeds_BLD[rows], neg, scales[expert], cond)
            out = out.index_copy(0, rows, v)
        return out

    def _guided(
        self,
        model: nn.Module,
        latents: torch.Tensor,
        timesteps_B: torch.Tensor,
        embeds_BLD: torch.Tensor,
        negative_BLD: torch.Tensor | None,
        guidance_scale: float,
        condition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One expert's CFG output for its rows (fp32); `condition` (image-to-video) joins the latents channel-wise,
        the same for cond and uncond as upstream."""
        batch = latents.shape[0]
        x = latents.to(self.dtype)
        if condition is not None:
            x = torch.cat([x, condition.to(device=x.device, dtype=self.dtype)], dim=1)
        text = embeds_BLD.to(self.dtype)
        if negative_BLD is not None:
            if negative_BLD.shape[1] != text.shape[1]:
                # No text mask in Wan: extra zero tokens change the output, so lengths must match upstream's.
                raise ValueError(
                    f"prompt ({text.shape[1]} tokens) and negative ({negative_BLD.shape[1]} tokens) "
                    f"encodings differ in length: encode both with the same max_sequence_length"
                )
            x = torch.cat([x, x])
            text = torch.cat([text, negative_BLD.to(self.dtype)])
            timesteps_B = torch.cat([timesteps_B, timesteps_B])
        timestep = timesteps_B
        if self.pipe.config.expand_timesteps:
            # Wan2.2 TI2V: one timestep per token, upstream's mask[0][0][:, ::2, ::2] layout.
            tokens = latents[0, 0, :, ::2, ::2].numel()
            timestep = timesteps_B[:, None].expand(-1, tokens)
        pred = model(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0].float()
        if negative_BLD is None:
            return pred
        cond, uncond = pred[:batch], pred[batch:]
        return uncond + guidance_scale * (cond - uncond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """uint8 videos (B, F, H, W, 3), equal to the pipeline's output_type="np" frames x255 rounded."""
        vae = self.pipe.vae
        z = latents.to(vae.device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
        video_BCFHW = vae.decode(z / inv_std + mean, return_dict=False)[0]  # upstream's exact op order
        frames = self.pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")  # (B, F, H, W, 3)
        return torch.from_numpy((frames * 255).round().astype(np.uint8))
