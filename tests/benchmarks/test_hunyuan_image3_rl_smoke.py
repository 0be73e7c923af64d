"""Smoke test of benchmarks/hunyuan_image3_rl.py: the HunyuanImage-3.0 FlowGRPO recipe through the engines-only step
core on a configs-only tiny folder built with random weights (`random:<folder>`), on the CPU, and what it records."""

from __future__ import annotations

import json

import pytest

from benchmarks import hunyuan_image3_rl


def test_smoke_run_records_images_per_second_from_its_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "hunyuan_image3_rl.json"
    result = hunyuan_image3_rl.main(["--smoke", "--out", str(out)])
    recorded = json.loads(out.read_text())
    assert recorded["images_per_gpu_s"] == pytest.approx(result["images_per_gpu_s"])
    steps = recorded["steps"]
    assert len(steps) == 2 and recorded["steps_measured"] == 1  # the first step is warm-up
    assert recorded["images_per_gpu_s"] == pytest.approx(4 / steps[1]["perf/time_per_step"])  # 2 prompts x 2
    assert 0 < recorded["trainable_parameters"] < recorded["parameters"]
    assert max(s["rollout_corr/logprob_abs_diff_max"] for s in steps) < 1e-5
