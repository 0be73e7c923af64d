"""Wan image-to-video (I2V) and first/last-frame-to-video (FLF2V) as a diffrl model adapter: Wan2.2 A14B's layout.

Mirrors `diffusers.pipelines.wan.pipeline_wan_i2v.WanImageToVideoPipeline` (diffusers 0.42.1) for folders without an
image encoder (Wan2.2-I2V-A14B: two experts, `boundary_ratio` 0.9, transformers with in_channels = 4 mask + 2 x 16
latent channels): the text, experts, schedule, CFG and decoding are the text-to-video adapter's
(diffrl/models/wan/adapter.py); the difference is the condition, made once per prompt with its images:
- the first frame (and, FLF2V, the last frame) is resized to the output size by the pipeline's `video_processor`
  (to [-1, 1]) and placed in a video of num_frames frames whose other frames are zeros;
- that video is VAE-encoded (the posterior's mode) and normalised with the VAE's latents_mean / latents_std:
  (1, z, F', H', W');
- a mask marks the given pixel frames (the first, and the last for FLF2V): the first frame's mark repeated over the
  VAE's temporal factor T, then folded into (1, T, F', H', W');
- [mask, latents] (1, T + z, F', H', W') joins the noisy latents channel-wise before every forward, the same for the
  conditional and unconditional halves of CFG; the noise has z channels (the VAE's, not the transformer's).

Where the images come from: `encode_prompt(prompts, images=[...], last_images=[...], shape=...)`, one first frame (a
path or a PIL image) per prompt, optionally one last frame; the rollout engine passes each sample's metadata["image"]
(and metadata["last_image"]) and keys its embedding cache by the prompt, the images' content digests and the sample
shape (diffrl/engines/rollout/engine.py): the condition rides in the encoding, stored with the text in the
prompt-embedding table, so the VAE encodes a prompt's frames once a run and replay reads them back.

Deviations (besides the text-to-video adapter's): folders with a CLIP image encoder (Wan2.1 I2V / FLF2V, transformer
`image_dim` set) and Wan2.2 TI2V-5B's image-to-video (`expand_timesteps`: the first frame pasted into the latents) are
refused with a ValueError; a condition made for another sample shape is an error, not silently resized.

Legend: B batch, z VAE latent channels, T the VAE's temporal factor (mask channels), F' latent frames, H'/W' latent
height/width, F/H/W output frames/height/width.
"""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from diffrl.models.base import Encoding, SampleShape, load_pipeline, register_adapter
from diffrl.models.qwen_image.adapter_edit import load_image
from diffrl.models.wan.adapter import WanAdapter


@register_adapter
class WanImageToVideoAdapter(WanAdapter):
    """Wan2.2 A14B image-to-video and first/last-frame-to-video (WanImageToVideoPipeline folders, no image encoder)."""

    arch = "wan_i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    input_image = True
    last_image = True
    condition_on_shape = True

    @classmethod
    def from_pretrained(
        cls, path: str, *, device="cpu", dtype=torch.float32, guidance_scale_2: float | None = None, **kwargs
    ) -> "WanImageToVideoAdapter":
        """Load a WanImageToVideoPipeline folder (Wan2.2-I2V-A14B's layout). guidance_scale_2: the low-noise expert's
        CFG scale (two-expert folders only); None = guidance_scale."""
        if kwargs:
            raise ValueError(
                f"WanImageToVideoAdapter.from_pretrained got unknown arguments {sorted(kwargs)}; "
                "it takes only guidance_scale_2"
            )
        pipe = load_pipeline(WanImageToVideoPipeline, path, device=device, dtype=dtype)
        if pipe.transformer is not None and pipe.transformer.config.image_dim is not None:
            raise ValueError(
                f"{path!r}: Wan image-to-video with a CLIP image encoder (Wan2.1 I2V / FLF2V, transformer image_dim "
                f"{pipe.transformer.config.image_dim}) is not supported; diffrl takes Wan2.2-I2V-A14B's layout"
            )
        if pipe.config.expand_timesteps:
            raise ValueError(
                f"{path!r}: Wan2.2 TI2V-5B image-to-video (expand_timesteps=True) is not supported; its text-to-video "
                "mode loads as a WanPipeline folder"
            )
        adapter = cls(pipe, device=device, dtype=dtype, guidance_scale_2=guidance_scale_2)
        adapter.source = path
        return adapter

    def _latent_channels(self) -> int:
        """The noise has the VAE's z channels (the transformer takes z more plus the mask)."""
        return self.pipe.vae.config.z_dim

    def _condition(self, encoding: Encoding) -> torch.Tensor:
        return encoding["condition"]

    # ---- the prompt and its frames --------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(
        self,
        prompts: list[str],
        *,
        max_sequence_length: int | None = None,
        images: list[str | Image.Image] | None = None,
        last_images: list[str | Image.Image] | None = None,
        shape: SampleShape | None = None,
    ) -> Encoding:
        """{"prompt_embeds": (B, L, D) as the text-to-video adapter's, "condition": (B, T + z, F', H', W') the mask and
        the VAE latents of the first (and last) frames at `shape`}, as upstream's `encode_prompt` and
        `prepare_latents` make them for a batch of one each."""
        if images is None or len(images) != len(prompts):
            given = "none" if images is None else len(images)
            raise ValueError(
                f"wan_i2v animates a first frame: give one image per prompt ({len(prompts)} prompts, {given} images); "
                "in a prompt file, an 'image' column"
            )
        if last_images is not None and len(last_images) != len(prompts):
            raise ValueError(f"last_images has {len(last_images)} entries for {len(prompts)} prompts; give one each")
        if shape is None:
            raise ValueError("wan_i2v makes its condition at the sample size: pass shape=SampleShape(...)")
        self.check_shape(shape)
        lasts = last_images if last_images is not None else [None] * len(prompts)
        condition = [self._condition_one(image, last, shape) for image, last in zip(images, lasts)]
        text = super().encode_prompt(prompts, max_sequence_length=max_sequence_length)
        return {**text, "condition": torch.cat(condition).to(self.dtype)}

    def _condition_one(
        self, image: str | Image.Image, last: str | Image.Image | None, shape: SampleShape
    ) -> torch.Tensor:
        """(1, T + z, F', H', W') fp32: [mask, normalised VAE latents] of the frames given, the others zeros."""
        vae = self.pipe.vae
        if last is not None and shape.num_frames < 2:
            raise ValueError(f"num_frames={shape.num_frames}: a first and a last frame need a video of >= 2 frames")
        pixels = [self._pixels(image, shape)]  # (1, 3, 1, H, W) each, in [-1, 1]
        zeros = shape.num_frames - 1 - (last is not None)
        pixels.append(pixels[0].new_zeros(1, 3, zeros, shape.height, shape.width))
        if last is not None:
            pixels.append(self._pixels(last, shape))
        video = torch.cat(pixels, dim=2).to(device=vae.device, dtype=vae.dtype)
        latents = vae.encode(video).latent_dist.mode().to(device=self.device, dtype=torch.float32)
        z_dim = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=self.device).view(1, z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, dtype=torch.float32, device=self.device)
        latents = (latents - mean) * inv_std.view(1, z_dim, 1, 1, 1)
        return torch.cat([self._frame_mask(shape, last is not None, latents.shape[-2:]), latents], dim=1)

    def _pixels(self, image: str | Image.Image, shape: SampleShape) -> torch.Tensor:
        """One frame resized to the output size as the pipeline's video_processor does: (1, 3, 1, H, W) fp32."""
        frame = self.pipe.video_processor.preprocess(load_image(image), height=shape.height, width=shape.width)
        return frame.to(device=self.device, dtype=torch.float32).unsqueeze(2)

    def _frame_mask(self, shape: SampleShape, has_last: bool, latent_hw: torch.Size) -> torch.Tensor:
        """(1, T, F', H', W') fp32: 1 where a pixel frame is given. The first frame's mark is repeated T times, so the
        F + T - 1 marks fold into F' latent frames of T marks each (mask channel t of latent frame f = mark f*T + t)."""
        temporal = self.pipe.vae_scale_factor_temporal
        given = torch.zeros(shape.num_frames, dtype=torch.float32, device=self.device)
        given[0] = 1.0
        if has_last:
            given[-1] = 1.0
        marks = torch.cat([given[:1].repeat(temporal), given[1:]])
        folded_TF = marks.view(-1, temporal).transpose(0, 1)
        return folded_TF[None, :, :, None, None].expand(1, temporal, folded_TF.shape[1], *latent_hw).contiguous()

    # ---- denoiser ---------------------------------------------------------------------------------
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
        """Guided velocity (B, z, F', H', W') fp32 with each sample's condition joined channel-wise (see
        WanAdapter.velocity for the experts and CFG)."""
        condition = encoding.get("condition")
        if condition is None or condition.shape[2:] != latents.shape[2:]:
            got = None if condition is None else tuple(condition.shape[2:])
            raise ValueError(
                f"wan_i2v: the encoding's first-frame condition has latent size {got}, the latents "
                f"{tuple(latents.shape[2:])}: encode the prompt with its images at this sample shape"
            )
        return super().velocity(latents, sigma, encoding, negative, guidance_scale=guidance_scale, shape=shape)
