"""Qwen-Image-Edit adapter: mirrors diffusers' `QwenImageEditPipeline` (input image + instruction -> edited image)
at noise level 0; the denoiser, schedule, noise, true CFG and decoding are Qwen-Image's
(diffrl/models/qwen_image/adapter.py).

Upstream details reproduced here (diffusers 0.42 `pipelines/qwenimage/pipeline_qwenimage_edit.py`):
- the input image is resized to about 1024x1024 pixels at its aspect ratio (`calculate_dimensions(1024 * 1024,
  w / h)`, sides rounded to 32) with the pipeline's `image_processor.resize`, whatever the output size;
- the instruction and that resized image go through Qwen2.5-VL with its vision tower: the edit template
  (`<|vision_start|><|image_pad|><|vision_end|>` before the instruction) rendered by the folder's Qwen2VLProcessor,
  the last hidden layer of the non-padded tokens kept, the first 64 (template) tokens dropped; no truncation to
  `max_sequence_length` (upstream ignores it past checking it is <= 1024). The negative prompt is encoded with the
  same image;
- the resized image, preprocessed to [-1, 1], is VAE-encoded (the posterior's mode), normalised with the VAE's
  latents_mean / latents_std and packed into 2x2 patches: `image_latents` (1, L', C*4);
- each forward takes [noisy latents, image latents] along the sequence, `img_shapes` listing both grids, and the
  velocity is the output's first L tokens (the noisy part); mu of the schedule uses L only.

Deviations: cond and uncond run in one batched forward (text padded with the mask, as the Qwen-Image adapter does;
upstream runs two forwards), and samples whose input images have different grids run in separate forwards (the
transformer's RoPE takes one `img_shapes` for a whole batch). The processor is built from the folder's
`processor/` tokenizer and image processor without a video processor (transformers' video processors need
torchvision, which the CPU machines lack): the image path is the same.

Where the image comes from: `encode_prompt(prompts, images=[...])`, one image (a path or a PIL image) per prompt;
the rollout engine passes each sample's metadata["image"] and keys its embedding cache by the prompt and the image
file's content digest (diffrl/engines/rollout/engine.py). The encoding carries the image latents, so the VAE
encodes an input image once, like the text.

Legend: B batch, L noisy image tokens, L' input-image tokens, T text tokens, D text hidden size.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

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
from diffrl.models.qwen_image.adapter import _MAX_SEQUENCE_LENGTH_LIMIT, QwenImageAdapter, true_cfg

CONDITION_AREA = 1024 * 1024  # upstream's fixed pixel area of the conditioning image
IMAGE_KEYS = ("image_latents", "image_grid")  # the parts of an encoding that are the input image's, not the text's


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor (whose base class needs torchvision); images and text as
    upstream's processor renders them."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: str) -> ImageOnlyQwen2VLProcessor:
    """The `processor/` component of a Qwen-Image-Edit folder: its tokenizer and image processor."""
    sub = os.path.join(folder, "processor")
    if not os.path.isdir(sub):
        raise ValueError(f"{folder!r} has no processor/ folder: not a QwenImageEditPipeline folder")
    return ImageOnlyQwen2VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(sub), tokenizer=AutoTokenizer.from_pretrained(sub)
    )


@register_adapter
class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit (Qwen-Image's MMDiT conditioned on an input image through Qwen2.5-VL and its VAE latents)."""

    arch: ClassVar[str] = "qwen_image_edit"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("QwenImageEditPipeline",)
    input_image: ClassVar[bool] = True
    condition_area: int = CONDITION_AREA

    @classmethod
    def from_pretrained(
        cls, path: str, *, device="cpu", dtype=torch.float32, condition_area: int = CONDITION_AREA, **kwargs
    ) -> "QwenImageEditAdapter":
        """Load a QwenImageEditPipeline folder with `torch_dtype=dtype` and move it to `device`. `condition_area`:
        the pixel area the input image is resized to (upstream's 1024 x 1024 by default; a smaller one is a
        deviation from upstream that tests use to keep tiny models fast on the CPU)."""
        if kwargs:
            raise ValueError(f"unexpected options for qwen_image_edit: {sorted(kwargs)}; it takes condition_area")
        if condition_area < 32 * 32:
            raise ValueError(f"condition_area={condition_area} must be at least 32 x 32 pixels")
        folder = path.split(":", 1)[1] if path.startswith("random:") else path
        processor = load_processor(folder) if os.path.isdir(folder) else None
        extra = {} if processor is None else {"processor": processor}
        pipe = load_pipeline(QwenImageEditPipeline, path, device=device, dtype=dtype, components=extra)
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(f"{path!r}: guidance-distilled transformers (guidance_embeds=True) are not supported")
        adapter = cls(pipe, device=device, dtype=dtype)
        adapter.source = path
        adapter.condition_area = condition_area
        return adapter

    def fingerprint(self) -> str:
        """The text-encoding side's id; a non-default condition_area changes every encoding, so it is part of it."""
        base = super().fingerprint()
        return base if self.condition_area == CONDITION_AREA else f"{base}-area{self.condition_area}"

    # ---- the instruction and the input image ----------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(
        self,
        prompts: list[str],
        *,
        max_sequence_length: int | None = None,
        images: list[str | Image.Image] | None = None,
    ) -> Encoding:
        """{"prompt_embeds": (B, T, D), "prompt_embeds_mask": (B, T) int64, "image_latents": (B, L', C*4),
        "image_grid": (B, 2) int64 token rows and columns of L'} as upstream's `encode_prompt` and `prepare_latents`
        make them for each prompt with its image (batches of one, then right-padded)."""
        max_len = self.default_max_sequence_length if max_sequence_length is None else max_sequence_length
        if not 0 < max_len <= _MAX_SEQUENCE_LENGTH_LIMIT:
            raise ValueError(f"max_sequence_length={max_len} must be in [1, {_MAX_SEQUENCE_LENGTH_LIMIT}]")
        check_input_images(self.arch, prompts, images)
        return pad_and_cat([self._encode_one(p, load_image(im)) for p, im in zip(prompts, images)])

    def _encode_one(self, prompt: str, image: Image.Image) -> Encoding:
        pipe = self.pipe
        width, height, _ = calculate_dimensions(self.condition_area, image.size[0] / image.size[1])
        resized = pipe.image_processor.resize(image, height, width)
        inputs = pipe.processor(
            text=[pipe.prompt_template_encode.format(prompt)], images=resized, padding=True, return_tensors="pt"
        ).to(self.device)
        hidden_TD = pipe.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            output_hidden_states=True,
        ).hidden_states[-1][0]
        embeds_TD = hidden_TD[inputs["attention_mask"][0].bool()][pipe.prompt_template_encode_start_idx :]
        pixels = pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)
        text_dtype = pipe.text_encoder.dtype  # upstream encodes the image in the prompt embeddings' dtype
        latents = pipe._encode_vae_image(pixels.to(device=self.device, dtype=text_dtype), generator=None)
        channels, rows, cols = latents.shape[1], latents.shape[3], latents.shape[4]
        packed = QwenImageEditPipeline._pack_latents(latents, 1, channels, rows, cols)
        return {
            "prompt_embeds": embeds_TD[None].to(self.dtype),
            "prompt_embeds_mask": torch.ones(1, embeds_TD.shape[0], dtype=torch.long, device=self.device),
            "image_latents": packed.to(self.dtype),
            "image_grid": torch.tensor([[rows // 2, cols // 2]], dtype=torch.long, device=self.device),
        }

    # ---- denoiser ------------------------------------------------------------------------------------
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
        """Guided velocity (B, L, C*4) fp32 on the noisy tokens; the input image's latents ride along the sequence.
        True CFG as Qwen-Image (cond and uncond share a forward); one forward per input-image grid. Reading the grids
        (`image_grid`, a few ints) is one device-to-host copy per call: on a GPU it waits for the queued work."""

        def run(rows: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
            part = lambda enc: None if enc is None else {k: v[rows] for k, v in enc.items()}  # noqa: E731
            return self._velocity_grid(
                latents[rows], sigma[rows], part(encoding), part(negative), grid, guidance_scale, shape
            )

        return by_image_grid(latents, encoding, run)

    def _velocity_grid(self, latents, sigma, encoding, negative, grid, guidance_scale, shape) -> torch.Tensor:
        # Adapted from diffrl/models/qwen_image/adapter.py: QwenImageAdapter.velocity
        batch, length = latents.shape[0], latents.shape[1]
        timestep_B = (sigma.to(device=self.device, dtype=torch.float32) * 1000).to(self.dtype) / 1000
        condition = encoding["image_latents"][:, : grid[0] * grid[1]].to(device=self.device, dtype=self.dtype)
        hidden = torch.cat([latents.to(device=self.device, dtype=self.dtype), condition], dim=1)
        do_true_cfg = guidance_scale > 1 and negative is not None
        text_only = lambda enc: {k: v for k, v in enc.items() if k not in IMAGE_KEYS}  # noqa: E731
        text = pad_and_cat([text_only(encoding), text_only(negative)]) if do_true_cfg else text_only(encoding)
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
            img_shapes=[[(1, rows, cols), (1, grid[0], grid[1])]] * hidden.shape[0],
            return_dict=False,
        )[0][:, :length]
        if do_true_cfg:
            pred = true_cfg(pred[:batch], pred[batch:], guidance_scale)
        return pred.to(torch.float32)
