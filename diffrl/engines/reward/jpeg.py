"""JPEG (in)compressibility rewards from DDPO (Black et al., 2023, "Training Diffusion Models with
Reinforcement Learning"): the size of the image saved as JPEG quality 95, in kB, divided by 500.

jpeg_compressibility = -size_kB / 500 (smaller files score higher), jpeg_incompressibility =
+size_kB / 500. Deviation: videos score the mean over every `frame_stride`-th frame.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from diffrl.engines.reward.base import RewardOutput, check_positive, register_reward, sample_frames, to_uint8_numpy


@dataclass
class JpegOptions:
    """quality: JPEG quality (DDPO uses 95). frame_stride: for videos, score every n-th frame."""

    quality: int = 95
    frame_stride: int = 4
    batch_size: int = 64

    def __post_init__(self):
        if not 1 <= self.quality <= 100:
            raise ValueError(f"jpeg: option 'quality' must be in 1..100, got {self.quality}")
        check_positive(self.frame_stride, "frame_stride", "jpeg")
        check_positive(self.batch_size, "batch_size", "jpeg")


def jpeg_size_kb(image_HW3: np.ndarray, quality: int = 95) -> float:
    """Size in kB (1000 bytes, as DDPO) of the RGB image encoded as JPEG at `quality`."""
    buffer = io.BytesIO()
    Image.fromarray(image_HW3).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


@dataclass
class JpegReward:
    """Holds the options only; stateless otherwise (a dataclass to satisfy RewardFunction)."""

    name: str
    sign: float
    options: JpegOptions

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(images)
        scores = []
        for sample in array:
            sizes = [
                jpeg_size_kb(frame, self.options.quality) for frame in sample_frames(sample, self.options.frame_stride)
            ]
            scores.append(self.sign * float(np.mean(sizes)) / 500.0)
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            valid=torch.ones(len(scores), dtype=torch.bool),
            info={},
        )


@register_reward("jpeg_compressibility", options=JpegOptions)
def jpeg_compressibility(options: JpegOptions) -> JpegReward:
    """-size_kB / 500: rewards images that compress well."""
    return JpegReward(name="jpeg_compressibility", sign=-1.0, options=options)


@register_reward("jpeg_incompressibility", options=JpegOptions)
def jpeg_incompressibility(options: JpegOptions) -> JpegReward:
    """+size_kB / 500: rewards images that compress badly (detail, texture)."""
    return JpegReward(name="jpeg_incompressibility", sign=1.0, options=options)
