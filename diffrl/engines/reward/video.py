"""Temporal consistency of a video: how little consecutive frames differ.

    temporal_consistency = 1 - mean |x[f+1] - x[f]| / 255     over pixels, channels and consecutive frame pairs

of every `frame_stride`-th frame, in [0, 1]: a static video scores 1, one alternating black and white frames 0.
Why the mean absolute difference and not an SSIM-like or optical-flow term: it is linear in the pixels (exact
closed forms, no window or constants to tune), cheap at any resolution, and it measures what per-frame image
rewards cannot see, flicker and jumps between frames. It does not compensate motion, so it also penalises motion
itself and a frozen video maximises it: weigh it against a per-frame image reward (docs/rewards.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffrl.engines.reward.base import RewardOutput, check_positive, register_reward, to_uint8_numpy


def temporal_consistency(video_FHW3: np.ndarray) -> float:
    """1 - the mean absolute difference of consecutive frames of a uint8 video, scaled to [0, 1]."""
    if len(video_FHW3) < 2:
        raise ValueError(f"temporal consistency needs at least 2 frames, got {len(video_FHW3)}")
    # int16 per pair: a whole video in float would take 4x its memory
    total = sum(
        float(np.abs(video_FHW3[f + 1].astype(np.int16) - video_FHW3[f].astype(np.int16)).mean())
        for f in range(len(video_FHW3) - 1)
    )
    return 1.0 - total / (len(video_FHW3) - 1) / 255.0


@dataclass
class TemporalConsistencyOptions:
    """frame_stride: compare every n-th frame (1: all consecutive frames)."""

    frame_stride: int = 1
    batch_size: int = 16

    def __post_init__(self):
        check_positive(self.frame_stride, "frame_stride", "temporal_consistency")
        check_positive(self.batch_size, "batch_size", "temporal_consistency")


@dataclass
class TemporalConsistencyReward:
    """Holds the options only (a dataclass to satisfy RewardFunction)."""

    options: TemporalConsistencyOptions
    name: str = "temporal_consistency"

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    def __call__(self, videos, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(videos)  # an AudioBatch gives its video
        stride = self.options.frame_stride
        if array.ndim != 5 or len(range(0, array.shape[1], stride)) < 2:
            raise ValueError(
                f"temporal_consistency scores videos (B, F, H, W, 3) with at least 2 frames at frame_stride {stride}; "
                f"got shape {tuple(array.shape)}"
            )
        scores = [temporal_consistency(video[::stride]) for video in array]
        return RewardOutput(torch.tensor(scores, dtype=torch.float32), torch.ones(len(scores), dtype=torch.bool))


@register_reward("temporal_consistency", options=TemporalConsistencyOptions)
def temporal_consistency_reward(options: TemporalConsistencyOptions) -> TemporalConsistencyReward:
    """1 - mean |frame difference| / 255 of a video."""
    return TemporalConsistencyReward(options)
