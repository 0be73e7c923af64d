"""Smoke test of benchmarks/reward_geneval_lite.py: both scoring paths agree (the script exits otherwise) and
the JSON it records is consistent."""

from __future__ import annotations

import json

import pytest

from benchmarks import reward_geneval_lite


def test_reward_benchmark_records_both_paths(tmp_path):
    out = tmp_path / "result.json"
    result = reward_geneval_lite.main(["--images", "32", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    small, large = result["runs"]
    assert (small["image_size"], small["images"], large["image_size"], large["images"]) == (64, 32, 256, 2)
    for run in (small, large):
        assert run["speedup"] == pytest.approx(
            run["per_image_s"] / run["batched_s"], rel=0.05
        )  # both times are rounded
        assert 0.5 < run["mean_score"] <= 1.0  # rendered scenes under noise of std 20 stay mostly detectable
