"""HunyuanImage-3.0 text-to-image adapter: the reference sampler (`HunyuanImage3ForCausalMM.generate_image` with
`bot_task="image"` and an explicit image size, i.e. `prepare_model_inputs(mode="gen_image")` then
`HunyuanImage3Text2ImagePipeline.__call__`, github.com/Tencent-Hunyuan/HunyuanImage-3.0) step by step.

What the reference does, reproduced here (base model, generation_config.json: sequence_template "pretrain",
use_system_prompt "None", 50 steps, guidance 5.0, flow_shift 3.0):
- context: `<bos>` + `tokenizer.encode(prompt, add_special_tokens=False)` + the image block (model.py); no system
  prompt, no chat roles. The CFG branch is the same sequence with every prompt token replaced by `<cfg>` (the
  tokenizer wrapper's `uncond_p=1.0` text), so cond and uncond have the same length and positions;
- the image block's `<img_size_{image_base_size}>` and `<img_ratio_i>` tokens: i is the index of the requested
  height / width among the `ResolutionGroup(image_base_size)` buckets (layout.resolution_group); the requested
  size must be one of those buckets (the reference snaps any other size to the nearest one);
- initial noise: `randn_tensor((1, C, H / 16, W / 16), generator, dtype=bfloat16)` per image (the pipeline draws
  in bf16), upcast to fp32 here;
- schedule (`FlowMatchDiscreteScheduler(shift=flow_shift, reverse=True, solver="euler")`): sigma =
  linspace(1, 0, N + 1) shifted as shift * s / (1 + (shift - 1) s); the model sees t = 1000 sigma; Euler
  x <- x + (sigma_{i+1} - sigma_i) v, diffrl's ODE step with sigma as is;
- CFG (`ClassifierFreeGuidance`, guidance_rescale 0): v = v_uncond + s (v_cond - v_uncond) when s > 1, at every
  step; cond and uncond rows in one forward (the reference batches them too);
- decode: latents / vae scaling_factor (+ shift_factor when set), the VAE decoder on one frame, (x / 2 + 0.5)
  clamped to [0, 1], x 255 rounded to uint8 (VaeImageProcessor's PIL output).

Not supported: the prompt-rewriting / reasoning modes (`bot_task` "think" / "recaption" generate text first), the
automatic aspect ratio (`image_size="auto"` samples a `<img_ratio_i>` token), system prompts, image inputs
(editing; the Instruct checkpoints), the KV cache (model.py).
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from diffrl.models.bagel.adapter import BagelPipeline
from diffrl.models.base import Encoding, ModelAdapter, SampleShape, register_adapter
from diffrl.models.hunyuan_image3 import layout
from diffrl.models.kind import RANDOM


class HunyuanImage3Pipeline(BagelPipeline):
    """The components of a HunyuanImage-3.0 folder under the names diffrl's trainer reads (`transformer` is the
    module LoRA goes into); LoRA files are written as BAGEL's (diffusers' layout)."""


@register_adapter
class HunyuanImage3Adapter(ModelAdapter):
    """HunyuanImage-3.0 (autoregressive MoE transformer with an in-model flow-matching image head)."""

    arch: ClassVar[str] = "hunyuan_image3"
    pipeline_classes: ClassVar[tuple[str, ...]] = ()  # no model_index.json: layout.is_folder detects it
    # attention and every MLP of the backbone (the 64 routed experts and the shared one), all of which image tokens use
    default_lora_targets: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj", "gate_and_up_proj", "down_proj")
    default_guidance_scale: ClassVar[float] = 5.0  # generation_config.json diff_guidance_scale
    default_max_sequence_length: ClassVar[int] = 1024  # the reference does not truncate; diffrl stops here

    def __init__(self, pipe: HunyuanImage3Pipeline, *, device="cpu", dtype=torch.float32, **options):
        super().__init__(pipe, device=device, dtype=dtype)
        self.flow_shift = float(options.pop("flow_shift", 3.0))
        if options:
            raise ValueError(f"unexpected options for hunyuan_image3: {sorted(options)}; it takes flow_shift")
        if self.flow_shift <= 0:
            raise ValueError(f"flow_shift must be > 0; got {self.flow_shift}")
        self.buckets = layout.resolution_group(self.transformer.hy.image_base_size)

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype=torch.float32, **options) -> "HunyuanImage3Adapter":
        """Load a HunyuanImage-3.0 folder (docs/models.md lists its files); `random:<folder>` builds a configs-only
        folder (config.json + tokenizer.json) with random weights. options: flow_shift (default: the folder's
        generation_config.json, else 3.0)."""
        device = torch.device(device)
        folder = path.removeprefix(RANDOM)
        layout.check_folder(folder, weights=not path.startswith(RANDOM))
        config = layout.read_config(folder)
        options.setdefault("flow_shift", layout.read_generation_config(folder)["flow_shift"])
        if path.startswith(RANDOM):
            transformer, vae = layout.random_weights(config, device=device, dtype=dtype)
        else:
            transformer, vae = layout.load_weights(folder, config, device=device, dtype=dtype)
        tokenizer, token_ids = layout.load_tokenizer(folder, config)
        adapter = cls(
            HunyuanImage3Pipeline(transformer, vae, tokenizer, token_ids), device=device, dtype=dtype, **options
        )
        adapter.source = path
        return adapter

    # ---- geometry ------------------------------------------------------------------------------------------------
    @property
    def _factor(self) -> int:
        return self.transformer.hy.vae_factor

    def check_shape(self, shape: SampleShape) -> None:
        """height x width must be one of the model's resolution buckets (and a multiple of 16); images only."""
        if shape.num_frames != 1:
            raise ValueError(f"num_frames={shape.num_frames}: HunyuanImage-3.0 generates images, num_frames must be 1")
        fits = [hw for hw in self.buckets if hw[0] % self._factor == 0 and hw[1] % self._factor == 0]
        if (shape.height, shape.width) not in fits:
            listed = ", ".join(f"{h}x{w}" for h, w in fits)
            raise ValueError(
                f"height x width = {shape.height}x{shape.width} is not one of HunyuanImage-3.0's resolution buckets "
                f"for image_base_size {self.transformer.hy.image_base_size} (multiples of {self._factor}): {listed}"
            )

    def _ratio_index(self, shape: SampleShape) -> int:
        ratios = torch.tensor([h / w for h, w in self.buckets], dtype=torch.float64)
        return int(torch.argmin((ratios - shape.height / shape.width).abs()))

    # ---- text ----------------------------------------------------------------------------------------------------
    def needs_negative(self, guidance_scale: float) -> bool:
        """Never: the CFG branch is the prompt with its tokens replaced by <cfg> (no negative prompt)."""
        return False

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], *, max_sequence_length: int | None = None) -> Encoding:
        """{"text_ids": (B, T) int64, "text_mask": (B, T) int64}: <bos> prompt per prompt, right padded; more than
        max_sequence_length prompt tokens are cut (with a warning; the reference never cuts)."""
        limit = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if limit < 1:
            raise ValueError(f"max_sequence_length={limit} must be >= 1")
        rows = []
        for prompt in prompts:
            tokens = self.pipe.tokenizer.encode(prompt, add_special_tokens=False)
            if len(tokens) > limit:
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {len(tokens)} tokens, more than max_sequence_length={limit}: "
                    f"cut to {limit}",
                    stacklevel=3,
                )
                tokens = tokens[:limit]
            rows.append([self.pipe.token_ids["bos"], *tokens])
        longest = max(len(r) for r in rows)
        text_ids = torch.zeros(len(rows), longest, dtype=torch.long)
        text_mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            text_ids[i, : len(row)] = torch.tensor(row)
            text_mask[i, : len(row)] = 1
        return {"text_ids": text_ids.to(self.device), "text_mask": text_mask.to(self.device)}

    def uncond_ids(self, text_ids_BT: torch.Tensor, text_mask_BT: torch.Tensor) -> torch.Tensor:
        """The CFG branch's text: every real prompt token (not <bos>) replaced by <cfg>."""
        prompt = text_mask_BT.bool().clone()
        prompt[:, 0] = False
        return torch.where(prompt, torch.full_like(text_ids_BT, self.pipe.token_ids["cfg"]), text_ids_BT)

    # ---- schedule and noise --------------------------------------------------------------------------------------
    def sigmas(self, num_inference_steps: int, shape: SampleShape) -> torch.Tensor:
        """(N + 1,) fp32: linspace(1, 0, N + 1) under the flow shift (ends in 0)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps} must be >= 1")
        self.check_shape(shape)
        s = torch.linspace(1, 0, num_inference_steps + 1)
        return (self.flow_shift * s / (1 + (self.flow_shift - 1) * s)).to(torch.float32)

    def prepare_latents(self, shape: SampleShape, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, C, H / 16, W / 16) fp32: sample i is `randn((1, C, h, w), generators[i], bf16)`, as the reference."""
        self.check_shape(shape)
        one = (1, self.transformer.hy.latent_channels, shape.height // self._factor, shape.width // self._factor)
        draws = [torch.randn(one, generator=g, device=g.device, dtype=torch.bfloat16) for g in generators]
        return torch.cat(draws).to(device=self.device, dtype=torch.float32)

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
        """Guided velocity (B, C, h, w) fp32 at per-sample sigma (B,): cond and <cfg> rows in one forward."""
        batch = latents.shape[0]
        t = sigma.to(device=self.device, dtype=torch.float32) * 1000.0
        x = latents.to(device=self.device, dtype=self.dtype)
        ids, mask = encoding["text_ids"], encoding["text_mask"]
        if guidance_scale > 1.0:
            x, t = torch.cat([x, x]), torch.cat([t, t])
            ids, mask = torch.cat([ids, self.uncond_ids(ids, mask)]), torch.cat([mask, mask])
        markers = dict(self.pipe.token_ids)
        markers["ratio"] = markers["ratio_offset"] + self._ratio_index(shape)
        pred = self.transformer(x, t, ids, mask, markers).float()
        if guidance_scale <= 1.0:
            return pred
        cond, uncond = pred[:batch], pred[batch:]
        return uncond + guidance_scale * (cond - uncond)

    # ---- pixels --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: SampleShape) -> torch.Tensor:
        """(B, H, W, 3) uint8 as the reference pipeline's decode and PIL postprocess (rounded); one image at a time
        (the 3D decoder's activations at 1024x1024 are several GB per image)."""
        image = torch.cat([self.pipe.vae.decode(z[None]) for z in latents.to(self.device)])
        image = (image.float() / 2 + 0.5).clamp(0, 1) * 255
        return image.round().permute(0, 2, 3, 1).to(torch.uint8).cpu()

    # ---- trainer hooks -------------------------------------------------------------------------------------------
    def fsdp_wrap_units(self) -> list[torch.nn.Module]:
        """The decoder layers."""
        return list(self.transformer.layers)
