"""Smoke test of benchmarks/omni_rl.py: the GSPO recipe through the engines-only step core (build_engines without a
store + run_step with DirectStages) on a config-only tiny Thinker built with random weights (`random:<folder>`), on
the CPU, and the figures it records."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import omni_rl


def test_smoke_run_records_token_rates_from_its_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "omni_rl.json"
    result = omni_rl.main(["--smoke", "--out", str(out)])
    recorded = json.loads(out.read_text())
    assert recorded["rollout_tokens_per_s"] == pytest.approx(result["rollout_tokens_per_s"])
    steps = recorded["steps"]
    assert len(steps) == 2 and recorded["steps_measured"] == 1  # the first step is warm-up
    last = steps[1]
    assert last["response_tokens"] == pytest.approx(4 * last["response_length/mean"])  # 2 prompts x 2 samples
    assert recorded["rollout_tokens_per_s"] == pytest.approx(last["response_tokens"] / last["timing_s/generate"])
    assert recorded["update_tokens_per_s"] == pytest.approx(last["response_tokens"] / last["timing_s/update_actor"])
    assert recorded["samples_per_gpu_s"] == pytest.approx(4 / last["perf/time_per_step"])
    assert 0 < recorded["trainable_parameters"] < recorded["parameters"]  # LoRA on the language model's attention
    assert max(s["rollout_corr/logprob_abs_diff_max"] for s in steps) < 1e-5
    assert statistics.fmean(s["actor/entropy"] for s in steps) > 0
