"""BAGEL text-to-image adapter: the reference sampler (`Bagel.generate_image` / `_forward_flow` of
github.com/ByteDance-Seed/Bagel, called as `InterleaveInferencer` calls it for a text prompt) step by step.

What the reference does, reproduced here:
- context: `[<|im_start|>] + tokenizer.encode(prompt) + [<|im_end|>]` (no chat template, no system prompt; the
  "think" mode is not supported); the text-CFG branch has no text at all (its context is the empty one);
- initial noise: `torch.randn(h * w, 4 * C)` per image, already in 2x2-patch layout (rows of patches row-major, each
  patch (p, q, c) with c fastest), drawn in fp32 on the CPU; here from the sample's generator;
- schedule: t = linspace(1, 0, N + 1) shifted as shift * t / (1 + (shift - 1) * t) (timestep_shift, default 3.0);
  BAGEL's num_timesteps counts the points, so N diffrl steps = num_timesteps N + 1 (the reference's default 50 is 49
  steps); t is the noise level (x_t = (1 - t) x_0 + t noise), the velocity points from data to noise and
  x_{i+1} = x_i - v (t_i - t_{i+1}), diffrl's x + (sigma_{i+1} - sigma_i) v with sigma = t;
- text CFG (cfg_text_scale = diffrl's guidance_scale, default 4.0) only where cfg_interval[0] < t <= cfg_interval[1]
  (default (0.4, 1.0)), then CFG-renorm: "global" (default) scales the guided velocity down to the conditional one's
  norm over the whole image, clamp(|v_c| / |v_g|, cfg_renorm_min, 1); "channel" and "text_channel" per token;
- decode: unpatchify, z / 0.3611 + 0.1159, the FLUX VAE decoder, (x * 0.5 + 0.5).clamp(0, 1) * 255 truncated to
  uint8 (the reference's `.to(torch.uint8)`, not rounded).

Image CFG (cfg_img_scale) guides edits towards the input image; for text-to-image its context equals the
conditional one, so cfg_img_scale > 1 only extrapolates the text-guided velocity (v_c + s (v_g - v_c)), which the
reference applies when called with it (its gradio app's text-to-image keeps the inferencer's default 1.5; the
notebook passes 1.0, the default here). Editing (an input image through the VAE and the ViT) is not supported.

Deviations: the reference's "global" renorm takes the norm over its whole packed batch (it samples one image at a
time); here it is per image, which equals a batch of one. Cond and text-uncond rows run in one forward (text padded
and masked: tests/models/test_bagel.py checks this equals separate forwards); the uncond rows are only the samples
inside the CFG interval, and whether any sample is costs one host sync per step.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from diffrl.models.bagel import layout
from diffrl.models.bagel.mot import BagelMoT
from diffrl.models.base import DiffusersLoraWriter, Encoding, ModelAdapter, SampleShape, register_adapter
from diffrl.models.kind import RANDOM

RENORM_TYPES = ("global", "channel", "text_channel")


class BagelPipeline(DiffusersLoraWriter):
    """The components of a BAGEL folder, under the names diffrl's trainer reads from a pipeline (`transformer` is
    the module LoRA goes into); not a diffusers pipeline."""

    def __init__(self, transformer: BagelMoT, vae, tokenizer, token_ids: dict[str, int]):
        self.transformer = transformer
        self.vae = vae
        self.tokenizer = tokenizer
        self.token_ids = token_ids

    @property
    def components(self) -> dict:
        return {"transformer": self.transformer, "vae": self.vae, "tokenizer": self.tokenizer}


@register_adapter
class BagelAdapter(ModelAdapter):
    """BAGEL (Mixture-of-Transformers on Qwen2, FLUX VAE): text-to-image through its generation expert."""

    arch: ClassVar[str] = "bagel"
    pipeline_classes: ClassVar[tuple[str, ...]] = ()  # no model_index.json: kind.is_bagel_folder detects it
    # the generation expert's attention and MLP projections only (the understanding expert stays as it is)
    default_lora_targets: ClassVar[tuple[str, ...]] = (
        "q_proj_moe_gen",
        "k_proj_moe_gen",
        "v_proj_moe_gen",
        "o_proj_moe_gen",
        "mlp_moe_gen.gate_proj",
        "mlp_moe_gen.up_proj",
        "mlp_moe_gen.down_proj",
    )
    default_guidance_scale: ClassVar[float] = 4.0  # cfg_text_scale
    default_max_sequence_length: ClassVar[int] = 1024  # the reference does not truncate; diffrl stops here

    def __init__(self, pipe: BagelPipeline, *, device="cpu", dtype=torch.float32, **options):
        super().__init__(pipe, device=device, dtype=dtype)
        self.timestep_shift = float(options.pop("timestep_shift", 3.0))
        self.cfg_interval = tuple(float(x) for x in options.pop("cfg_interval", (0.4, 1.0)))
        self.cfg_renorm_min = float(options.pop("cfg_renorm_min", 0.0))
        self.cfg_renorm_type = str(options.pop("cfg_renorm_type", "global"))
        self.cfg_img_scale = float(options.pop("cfg_img_scale", 1.0))
        if options:
            raise ValueError(
                f"unexpected options for bagel: {sorted(options)}; it takes timestep_shift, cfg_interval, "
                "cfg_renorm_min, cfg_renorm_type, cfg_img_scale"
            )
        if self.cfg_renorm_type not in RENORM_TYPES:
            raise ValueError(f"cfg_renorm_type must be one of {RENORM_TYPES}; got {self.cfg_renorm_type!r}")
        if len(self.cfg_interval) != 2 or not self.cfg_interval[0] <= self.cfg_interval[1]:
            raise ValueError(f"cfg_interval must be (low, high) with low <= high; got {self.cfg_interval}")
        if self.timestep_shift <= 0:
            raise ValueError(f"timestep_shift must be > 0; got {self.timestep_shift}")

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **options) -> "BagelAdapter":
        """Load a BAGEL folder (docs/models.md lists its files); `random:<folder>` builds a configs-only folder
        (llm_config.json + tokenizer) with random weights. options: the sampler's knobs (see __init__)."""
        device = torch.device(device)
        folder = path.removeprefix(RANDOM)
        if path.startswith(RANDOM):
            layout.check_folder(folder, weights=False)
            mot = layout.random_mot(folder, device=device, dtype=dtype)
            vae = layout.random_vae(device=device, dtype=dtype)
        else:
            layout.check_folder(folder)
            mot = layout.load_mot(folder, device=device, dtype=dtype)
            vae = layout.load_vae(folder, device=device, dtype=dtype)
        tokenizer, token_ids = layout.load_tokenizer(folder)
        too_big = [k for k, v in token_ids.items() if v >= mot.config.vocab_size]
        if too_big:
            raise ValueError(f"{folder!r}: the tokenizer's {too_big} ids lie past llm_config.json's vocab_size")
        if device.type == "cpu":
            vae.to(memory_format=torch.channels_last)  # as base.load_pipeline: ~2x faster CPU convolutions
        adapter = cls(BagelPipeline(mot, vae, tokenizer, token_ids), device=device, dtype=dtype, **options)
        adapter.source = path
        return adapter

    # ---- geometry ------------------------------------------------------------------------------------------------
    @property
    def _multiple(self) -> int:
        return 8 * layout.LATENT_PATCH_SIZE  # the VAE's 8x downsampling x 2x2 latent patches

    def _grid(self, shape: SampleShape) -> tuple[int, int]:
        return shape.height // self._multiple, shape.width // self._multiple

    def check_shape(self, shape: SampleShape) -> None:
        """height and width: positive multiples of 16, at most max_latent_size x 16; images only."""
        side = self.transformer.config.max_latent_size * self._multiple
        for name, value in (("height", shape.height), ("width", shape.width)):
            if value <= 0 or value % self._multiple or value > side:
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {self._multiple} (VAE factor 8 x 2x2 patches) "
                    f"and at most {side} (max_latent_size {self.transformer.config.max_latent_size}) for BAGEL"
                )
        if shape.num_frames != 1:
            raise ValueError(f"num_frames={shape.num_frames}: BAGEL generates images, num_frames must be 1")

    # ---- text ----------------------------------------------------------------------------------------------------
    def needs_negative(self, guidance_scale: float) -> bool:
        """Never: BAGEL's text-CFG branch drops the text (no negative prompt)."""
        return False

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"text_ids": (B, T) int64, "text_mask": (B, T) int64}: <|im_start|> prompt <|im_end|> per prompt, right
        padded; more than max_sequence_length prompt tokens are cut (with a warning; the reference never cuts)."""
        limit = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if limit < 1:
            raise ValueError(f"max_sequence_length={limit} must be >= 1")
        ids = self.pipe.token_ids
        rows = []
        for prompt in prompts:
            tokens = self.pipe.tokenizer.encode(prompt)
            if len(tokens) > limit:
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {len(tokens)} tokens, more than max_sequence_length={limit}: "
                    f"cut to {limit}",
                    stacklevel=3,
                )
                tokens = tokens[:limit]
            rows.append([ids["bos_token_id"], *tokens, ids["eos_token_id"]])
        longest = max(len(r) for r in rows)
        text_ids = torch.zeros(len(rows), longest, dtype=torch.long)
        text_mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            text_ids[i, : len(row)] = torch.tensor(row)
            text_mask[i, : len(row)] = 1
        return {"text_ids": text_ids.to(self.device), "text_mask": text_mask.to(self.device)}

    # ---- schedule and noise --------------------------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: linspace(1, 0, N + 1) under BAGEL's timestep shift (ends in 0)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.check_shape(shape)
        t = torch.linspace(1, 0, num_inference_steps + 1)
        s = self.timestep_shift
        return (s * t / (1 + (s - 1) * t)).to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, L, 4 C) fp32: sample i is `torch.randn(L, 4 C)` from generators[i] on the CPU, as the reference draws."""
        self.check_shape(shape)
        rows, cols = self._grid(shape)
        patch_dim = self.transformer.config.latent_channels * layout.LATENT_PATCH_SIZE**2
        noise = [torch.randn(rows * cols, patch_dim, generator=g, dtype=torch.float32) for g in generators]
        return torch.stack(noise).to(self.device)

    # ---- denoiser ------------------------------------------------------------------------------------------------
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
        """Guided velocity (B, L, 4 C) fp32 at per-sample t = sigma (B,): text CFG with BAGEL's interval and
        renorm; the conditional rows and the text-free rows of the samples inside the interval share one forward."""
        batch = latents.shape[0]
        sigma = sigma.to(device=self.device, dtype=torch.float32)
        lo, hi = self.cfg_interval
        guided_B = (sigma > lo) & (sigma <= hi) if guidance_scale > 1.0 else torch.zeros_like(sigma, dtype=torch.bool)
        rows = guided_B.nonzero().flatten().tolist()  # the one host sync: which samples need the uncond branch
        x = latents.to(device=self.device, dtype=torch.float32)
        ids, mask = encoding["text_ids"], encoding["text_mask"]
        if rows:
            x = torch.cat([x, x[rows]])
            sigma = torch.cat([sigma, sigma[rows]])
            ids = torch.cat([ids, torch.zeros_like(ids[rows])])
            mask = torch.cat([mask, torch.zeros_like(mask[rows])])
        marker_ids = (self.pipe.token_ids["start_of_image"], self.pipe.token_ids["end_of_image"])
        pred = self.transformer(x, sigma, ids, mask, marker_ids, self._grid(shape)).float()
        cond = pred[:batch]
        if not rows:
            return cond
        guided = self._guide(cond[rows], pred[batch:], guidance_scale)
        return cond.index_put((torch.tensor(rows, device=cond.device),), guided)

    def _guide(self, cond_BLP: torch.Tensor, uncond_BLP: torch.Tensor, scale: float) -> torch.Tensor:
        """BAGEL's text CFG and CFG-renorm (and for cfg_img_scale > 1 the image-CFG extrapolation, whose context
        for text-to-image equals the conditional one)."""
        guided = uncond_BLP + scale * (cond_BLP - uncond_BLP)
        if self.cfg_renorm_type == "text_channel":
            guided = guided * _renorm(cond_BLP, guided, self.cfg_renorm_min, per_token=True)
            if self.cfg_img_scale > 1.0:
                guided = cond_BLP + self.cfg_img_scale * (guided - cond_BLP)
            return guided
        if self.cfg_img_scale > 1.0:
            guided = cond_BLP + self.cfg_img_scale * (guided - cond_BLP)
        per_token = self.cfg_renorm_type == "channel"
        return guided * _renorm(cond_BLP, guided, self.cfg_renorm_min, per_token=per_token)

    # ---- pixels --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8 as the reference's decode_image: unpatchify, unscale, VAE decode, truncate."""
        vae = self.pipe.vae
        rows, cols = self._grid(shape)
        p, channels = layout.LATENT_PATCH_SIZE, self.transformer.config.latent_channels
        z = latents.to(self.device).reshape(-1, rows, cols, p, p, channels)
        z = torch.einsum("nhwpqc->nchpwq", z).reshape(-1, channels, rows * p, cols * p)
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        image = (image.float() * 0.5 + 0.5).clamp(0, 1) * 255
        return image.permute(0, 2, 3, 1).to(torch.uint8).cpu()

    # ---- trainer hooks -------------------------------------------------------------------------------------------
    def fsdp_wrap_units(self) -> list[torch.nn.Module]:
        """The MoT decoder layers."""
        return list(self.transformer.layers)


def _renorm(cond_BLP: torch.Tensor, guided_BLP: torch.Tensor, minimum: float, *, per_token: bool) -> torch.Tensor:
    """clamp(|cond| / (|guided| + 1e-8), minimum, 1): per image over (L, 4 C), or per token over 4 C."""
    dims = (-1,) if per_token else (-2, -1)
    ratio = torch.linalg.vector_norm(cond_BLP, dim=dims, keepdim=True) / (
        torch.linalg.vector_norm(guided_BLP, dim=dims, keepdim=True) + 1e-8
    )
    return ratio.clamp(min=minimum, max=1.0)
