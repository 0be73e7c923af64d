"""Smoke test of benchmarks/fp8_linear.py on the CPU: the emulated FP8 path at a tiny shape, and its JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import fp8_linear


def test_fp8_linear_tiny_cpu_writes_result(tmp_path):
    out = tmp_path / "fp8.json"
    argv = ["--device", "cpu", "--shapes", "64x32x48", "--repeats", "2", "--warmup", "1", "--no-compile"]
    result = fp8_linear.main([*argv, "--out", str(out)])
    recorded = json.loads(out.read_text())
    assert recorded["device"] == "cpu" and recorded["command"].startswith("python -m benchmarks.fp8_linear")
    row = recorded["shapes"][0]
    assert (row["M"], row["K"], row["N"], row["scaled_mm"]) == (64, 32, 48, False)
    assert set(row["paths"]) == {"linear_eager", "fp8_emulated_eager"}
    assert all(p["ms"] > 0 and p["tflops"] > 0 for p in row["paths"].values())
    # per-token and per-row e4m3 (3 mantissa bits) on random data: well inside 2 * 2**-4 of each row's scale
    assert 0 < row["error_fp8_emulated_vs_linear"]["mean"] < row["error_fp8_emulated_vs_linear"]["max"] < 0.125
    assert result["shapes"][0]["paths"]["linear_eager"]["ms"] == pytest.approx(row["paths"]["linear_eager"]["ms"])


def test_fp8_linear_rejects_unaligned_shapes():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear.parse_shapes("64x30x48")
    with pytest.raises(ValueError, match="MxKxN"):
        fp8_linear.parse_shapes("64x32")
