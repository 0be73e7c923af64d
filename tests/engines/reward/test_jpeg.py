"""JPEG compressibility rewards (DDPO)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engines.reward.base import build_reward


def _images(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    flat = np.full((64, 64, 3), 128, dtype=np.uint8)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return np.stack([flat, noise])


def test_flat_image_is_more_compressible_than_noise():
    images = _images()
    out = build_reward("jpeg_compressibility", {})(images, ["", ""], [{}, {}])
    assert out.scores.dtype == torch.float32 and out.valid.all()
    assert out.scores[0] > out.scores[1]
    inverse = build_reward("jpeg_incompressibility", {})(torch.from_numpy(images), ["", ""], [{}, {}])
    assert torch.equal(inverse.scores, -out.scores)


def test_score_is_minus_q95_kilobytes_over_500():
    image = _images()[1]
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    out = build_reward("jpeg_compressibility", {})(image[None], [""], [{}])
    assert out.scores[0].item() == pytest.approx(-len(buffer.getvalue()) / 1000 / 500, rel=1e-6)


def test_video_averages_every_fourth_frame():
    flat, noise = _images()
    video = np.stack([flat, noise, noise, noise, noise, noise])  # frames 0 and 4 are scored
    reward = build_reward("jpeg_compressibility", {})
    frames = reward(np.stack([flat, noise]), ["", ""], [{}, {}]).scores
    out = reward(video[None], [""], [{}])
    assert out.scores[0].item() == pytest.approx(frames.mean().item(), rel=1e-6)


def test_bad_image_arrays_are_rejected():
    reward = build_reward("jpeg_compressibility", {})
    with pytest.raises(ValueError, match="uint8"):
        reward(np.zeros((1, 8, 8, 3), dtype=np.float32), [""], [{}])
    with pytest.raises(ValueError, match="shape"):
        reward(np.zeros((1, 8, 8), dtype=np.uint8), [""], [{}])
