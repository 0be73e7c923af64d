"""Image statistics of the hacking guard (docs/training.md, "Hacking guard"): pure functions of uint8 images.

A reward that is hacked usually shows in the images before it shows in the reward: they go dark, grey or flat (a UniRL
report: an OCR reward without KL drove the share of dark pixels from 0.45 to 0.93). Each statistic is one number per
image, computed on the decoded images the reward stage scores (no extra decode).

Legend: images_NHW3 are N uint8 RGB images of H x W; a video's frames are images of their own (`per_sample_stats`).

    brightness      mean Rec. 601 luma Y = 0.299 R + 0.587 G + 0.114 B, in [0, 1]
    colourfulness   Hasler & Suesstrunk (2003), "Measuring colourfulness in natural images", on the 0-255 scale:
                    rg = R - G, yb = (R + G) / 2 - B,
                    M = sqrt(std(rg)^2 + std(yb)^2) + 0.3 sqrt(mean(rg)^2 + mean(yb)^2)
                    (std: the population std over the image's pixels); 0 for a grey image
    edge_density    the share of interior pixels (a 1-pixel border left out) whose Sobel gradient magnitude on the
                    luma in [0, 1], sqrt(gx^2 + gy^2) with the kernels divided by 8 (a ramp of slope s per pixel gives
                    s), exceeds EDGE_THRESHOLD
"""

from __future__ import annotations

import torch

STATISTICS = ("brightness", "colourfulness", "edge_density")
EDGE_THRESHOLD = 0.1  # a luma change of 10 % of the range per pixel
_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601
_BATCH = 8  # images measured at once: float copies of a few images at a time, whatever the batch


def _rgb(images_NHW3: torch.Tensor) -> torch.Tensor:
    """(N, H, W, 3) float32 on the 0-255 scale; TypeError unless uint8 RGB."""
    if images_NHW3.dtype != torch.uint8 or images_NHW3.ndim != 4 or images_NHW3.shape[-1] != 3:
        raise TypeError(f"image statistics take uint8 images (N, H, W, 3), got {images_NHW3.dtype} {images_NHW3.shape}")
    return images_NHW3.float()


def _luma(rgb_NHW3: torch.Tensor) -> torch.Tensor:
    """(N, H, W) luma in [0, 1]."""
    return rgb_NHW3 @ torch.tensor(_LUMA, device=rgb_NHW3.device).div(255.0)


_OPPONENT = ((1.0, 0.5), (-1.0, 0.5), (0.0, -1.0))  # RGB -> (rg, yb) = (R - G, (R + G) / 2 - B)


def _colourfulness(rgb_NHW3: torch.Tensor) -> torch.Tensor:
    opponent = rgb_NHW3 @ torch.tensor(_OPPONENT, device=rgb_NHW3.device)  # (N, H, W, 2): rg, yb in one pass
    var, mean = torch.var_mean(opponent, dim=(1, 2), correction=0)  # (N, 2) each
    return var.sum(1).sqrt() + 0.3 * mean.square().sum(1).sqrt()


def _edge_density(luma_NHW: torch.Tensor, threshold: float) -> torch.Tensor:
    if luma_NHW.shape[-1] < 3 or luma_NHW.shape[-2] < 3:
        raise ValueError(f"edge density needs images of at least 3 x 3 pixels, got {tuple(luma_NHW.shape[-2:])}")
    # the separable Sobel kernels [1, 2, 1]^T [-1, 0, 1] / 8 on the interior: no padding to invent edges at the border
    smooth_rows = luma_NHW[:, :-2] + 2 * luma_NHW[:, 1:-1] + luma_NHW[:, 2:]  # (N, H-2, W)
    smooth_cols = luma_NHW[:, :, :-2] + 2 * luma_NHW[:, :, 1:-1] + luma_NHW[:, :, 2:]  # (N, H, W-2)
    gx = (smooth_rows[:, :, 2:] - smooth_rows[:, :, :-2]) / 8
    gy = (smooth_cols[:, 2:] - smooth_cols[:, :-2]) / 8
    return (gx.square() + gy.square() > threshold**2).float().mean((1, 2))


def brightness(images_NHW3: torch.Tensor) -> torch.Tensor:
    """(N,) mean luma of each image, in [0, 1]."""
    return _luma(_rgb(images_NHW3)).mean((1, 2))


def colourfulness(images_NHW3: torch.Tensor) -> torch.Tensor:
    """(N,) Hasler & Suesstrunk's colourfulness M of each image (0-255 scale)."""
    return _colourfulness(_rgb(images_NHW3))


def edge_density(images_NHW3: torch.Tensor, threshold: float = EDGE_THRESHOLD) -> torch.Tensor:
    """(N,) share of each image's interior pixels whose Sobel gradient magnitude exceeds `threshold`."""
    return _edge_density(_luma(_rgb(images_NHW3)), threshold)


def _all_stats(images_NHW3: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three statistics of each image, each image converted to float once, a few images at a time."""
    parts = []
    for batch in images_NHW3.split(_BATCH):
        rgb = _rgb(batch)
        luma = _luma(rgb)
        parts.append((luma.mean((1, 2)), _colourfulness(rgb), _edge_density(luma, EDGE_THRESHOLD)))
    return {name: torch.cat(values) for name, values in zip(STATISTICS, zip(*parts))}


def per_sample_stats(outputs: object) -> dict[str, torch.Tensor] | None:
    """{statistic: (B,)} of a batch of decoded outputs: images (B, H, W, 3) or videos (B, F, H, W, 3) (a video's
    statistic is the mean over its frames). None for outputs that are not uint8 RGB images (texts, audio)."""
    if not isinstance(outputs, torch.Tensor) or outputs.dtype != torch.uint8 or outputs.ndim not in (4, 5):
        return None
    if outputs.shape[-1] != 3:
        return None
    frames = outputs.shape[1] if outputs.ndim == 5 else 1
    stats = _all_stats(outputs.reshape(-1, *outputs.shape[-3:]))
    return {name: values.view(-1, frames).mean(1) for name, values in stats.items()}


def stat_sums(outputs: object) -> dict[str, float]:
    """{statistic: sum over the batch} (what a chunk reports; the step's mean divides by its images); {} for outputs
    that are not images."""
    stats = per_sample_stats(outputs)
    return {} if stats is None else {name: float(values.double().sum()) for name, values in stats.items()}


# statistic -> its metric's name under guard/ (a step's mean over its images)
METRIC_NAMES = {"brightness": "brightness_mean", "colourfulness": "colourfulness_mean", "edge_density": "edge_density"}


def stat_metrics(sums: dict[str, float], count: int, prefix: str = "guard/") -> dict[str, float]:
    """guard/brightness_mean, guard/colourfulness_mean, guard/edge_density: the means over `count` images of the
    statistics whose sums are `sums`; {} when nothing was measured."""
    if not sums or count <= 0:
        return {}
    return {f"{prefix}{METRIC_NAMES[name]}": total / count for name, total in sums.items()}
