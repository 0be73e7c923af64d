"""The hacking guard's image statistics against their closed forms (diffrl/engines/reward/image_stats.py)."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.engines.reward.image_stats import (
    brightness,
    colourfulness,
    edge_density,
    per_sample_stats,
    stat_metrics,
    stat_sums,
)


def _constant(rgb: tuple[int, int, int], n: int = 2, size: int = 8) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.uint8).expand(n, size, size, 3).contiguous()


def _checkerboard(size: int, square: int) -> torch.Tensor:
    """One (1, size, size, 3) image of black and white squares of `square` pixels."""
    index = torch.arange(size) // square
    white = ((index[:, None] + index[None, :]) % 2).to(torch.uint8) * 255
    return white[None, :, :, None].expand(1, size, size, 3).contiguous()


def test_brightness_is_the_mean_rec601_luma():
    grey = _constant((128, 128, 128))
    assert torch.allclose(brightness(grey), torch.full((2,), 128 / 255))
    red_and_blue = torch.cat([_constant((255, 0, 0), 1), _constant((0, 0, 255), 1)])
    assert torch.allclose(brightness(red_and_blue), torch.tensor([0.299, 0.114]))
    half = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
    half[:, :, 2:] = 255  # half the pixels white
    assert brightness(half).item() == pytest.approx(0.5)


def test_colourfulness_follows_hasler_and_suesstrunk():
    assert torch.equal(colourfulness(_constant((90, 90, 90))), torch.zeros(2))  # grey: no colour at all
    # a flat pure red: rg = 255, yb = 127.5 everywhere, so M = 0.3 * sqrt(255^2 + 127.5^2)
    assert colourfulness(_constant((255, 0, 0), 1)).item() == pytest.approx(0.3 * math.hypot(255, 127.5), rel=1e-6)
    # half red, half green: rg = +-255 (std 255, mean 0), yb = 127.5 (std 0): M = 255 + 0.3 * 127.5
    image = _constant((255, 0, 0), 1, size=4)
    image[:, :, 2:] = torch.tensor([0, 255, 0], dtype=torch.uint8)
    assert colourfulness(image).item() == pytest.approx(255 + 0.3 * 127.5, rel=1e-6)


def test_edge_density_of_flat_images_steps_and_checkerboards():
    assert torch.equal(edge_density(_constant((200, 10, 10))), torch.zeros(2))
    # a vertical black/white step in a 10 x 10 image: the two interior columns beside it, of the 8 interior ones
    step = torch.zeros(1, 10, 10, 3, dtype=torch.uint8)
    step[:, :, 5:] = 255
    assert edge_density(step).item() == pytest.approx(2 / 8)
    # squares of 4 in 16 x 16: of the 14 interior rows (and columns) 1..14, 3,4,7,8,11,12 touch a square's border;
    # a pixel is an edge unless neither its row nor its column does: 1 - (8/14)^2
    assert edge_density(_checkerboard(16, 4)).item() == pytest.approx(1 - (8 / 14) ** 2)
    # a 1-pixel checkerboard is Sobel's blind spot (its kernels cancel at the Nyquist frequency)
    assert edge_density(_checkerboard(8, 1)).item() == 0.0


def test_videos_average_their_frames_and_other_outputs_have_no_statistics():
    frames = torch.stack([_constant((0, 0, 0), 1)[0], _constant((255, 255, 255), 1)[0]])  # (2, H, W, 3)
    video = frames[None].expand(3, *frames.shape)  # 3 videos of a black then a white frame
    assert torch.allclose(per_sample_stats(video)["brightness"], torch.full((3,), 0.5))
    assert per_sample_stats(["a text"]) is None and per_sample_stats(torch.zeros(2, 100)) is None
    assert stat_sums(["a text"]) == {} and stat_metrics({}, 0) == {}
    sums = stat_sums(_constant((255, 255, 255), 4))
    assert stat_metrics(sums, 4) == {
        "guard/brightness_mean": pytest.approx(1.0),
        "guard/colourfulness_mean": 0.0,
        "guard/edge_density": 0.0,
    }


def test_statistics_refuse_what_is_not_uint8_rgb():
    with pytest.raises(TypeError, match="uint8 images"):
        brightness(torch.zeros(1, 4, 4, 3))
    with pytest.raises(ValueError, match="3 x 3"):
        edge_density(torch.zeros(1, 2, 8, 3, dtype=torch.uint8))
