"""The update's throughput metrics: perf/update_tokens_per_s and perf/update_mfu, the model FLOPs it achieved per second
over the device's peak.

Peaks are NVIDIA's datasheet figures for dense bf16 Tensor Core math (the datasheets give twice these "with
sparsity"), matched by the CUDA device name as torch reports it; a CPU or a device not in the table has no peak and
its runs no perf/update_mfu.
"""

from __future__ import annotations

import torch

# (a substring of torch.cuda.get_device_name, dense bf16 FLOP/s); the first match wins, so variants come first
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("A100", 312e12),
)


def peak_flops_of(name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the CUDA device named `name` (torch.cuda.get_device_name), None if not listed."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak FLOP/s of a device (module docstring), None on CPU or for a device not in the table."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def add_update_rates(metrics: dict[str, float], seconds: float, device: torch.device | str) -> dict[str, float]:
    """perf/update_tokens_per_s (perf/update_tokens over `seconds`, the update's time) and, where the device's peak is
    known, perf/update_mfu (perf/update_flops per second over the peak); nothing for an update that counted no
    tokens."""
    tokens = metrics.get("perf/update_tokens")
    if tokens is None or seconds <= 0:
        return metrics
    metrics["perf/update_tokens_per_s"] = tokens / seconds
    peak = peak_flops(device)
    if peak is not None and "perf/update_flops" in metrics:
        metrics["perf/update_mfu"] = metrics["perf/update_flops"] / seconds / peak
    return metrics
