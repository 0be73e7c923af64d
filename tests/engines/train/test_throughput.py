"""The update's throughput metrics (diffrl/engines/train/throughput.py): datasheet peaks by device name, none on CPU."""

from __future__ import annotations

import pytest

from diffrl.engines.train.throughput import add_update_rates, peak_flops, peak_flops_of


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peaks_by_device_name(name, peak):
    assert peak_flops_of(name) == peak


def test_rates_over_the_update_time_and_no_mfu_on_cpu():
    metrics = add_update_rates({"perf/update_tokens": 1000.0, "perf/update_flops": 6e12}, 2.0, "cpu")
    assert metrics["perf/update_tokens_per_s"] == 500.0 and "perf/update_mfu" not in metrics
    assert peak_flops("cpu") is None
    assert add_update_rates({}, 2.0, "cpu") == {}  # a trainer that counts no tokens (the diffusion family)
