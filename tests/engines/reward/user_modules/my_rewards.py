"""Rewards a user writes in their own module, named in a config as `my_rewards:<function>` with this folder on
PYTHONPATH (docs/rewards.md). Plain functions: nothing of diffrl is imported."""

from __future__ import annotations

import numpy as np


def brightness(images, prompts, metadata, scale: float = 1.0):
    """The mean pixel value of each image in [0, 1], times `scale`."""
    return [scale * float(np.asarray(image, dtype=np.float64).mean()) / 255.0 for image in images]


def every_other(images, prompts, metadata):
    """1.0 for even samples; None (could not score) for odd ones, as a numpy object array."""
    return np.array([None if i % 2 else 1.0 for i in range(len(images))], dtype=object)


def prompt_length(images, prompts, metadata):
    """The prompt's length in characters, as a tensor (a text reward that ignores the image)."""
    import torch

    return torch.tensor([float(len(p)) for p in prompts])


def one_too_many(images, prompts, metadata):
    return [0.0] * (len(images) + 1)


def a_mapping(images, prompts, metadata):
    return {"score": 1.0}


def words(images, prompts, metadata):
    return ["high"] * len(images)


NOT_A_FUNCTION = 3


class Scorer:
    """A class: calling it would build an instance, not score."""
