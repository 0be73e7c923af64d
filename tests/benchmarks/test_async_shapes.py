"""benchmarks/async_shapes.py's summary against its closed forms on hand-written per-step records: images/s from the
median step after the warm-up, the gain over the synchronous run, the recompute's cost and the overlap; a
direct-preference algorithm's variants (no correction, no recompute)."""

from __future__ import annotations

import pytest

from benchmarks import async_shapes


def _run(seconds: list[float], generate: float, update: float) -> dict:
    steps = [{"perf/time_per_step": s, "timing_s/generate": generate, "timing_s/update_actor": update} for s in seconds]
    return {"build_seconds": 1.0, "per_step": steps}


def test_the_summary_gives_the_gain_the_recompute_cost_and_the_overlap():
    runs = {  # the first step (warm-up) is 10x slower and left out
        "sync": [_run([20.0, 2.0, 2.0, 2.0], 1.0, 1.0)],
        "sync_tis": [_run([25.0, 2.5, 2.5, 2.5], 1.0, 1.5), _run([25.0, 2.5, 2.4, 2.6], 1.0, 1.5)],
        "async1": [_run([16.0, 1.6, 1.6, 1.6], 1.0, 1.5)],
    }
    result = async_shapes.summary("c", [], runs, images=64, warmup=1)
    assert result["variants"]["sync"]["images_per_s"] == pytest.approx(32.0)
    assert result["variants"]["sync_tis"]["seconds_per_step"] == pytest.approx(2.5)  # median over both repeats
    assert result["gain"] == pytest.approx(2.0 / 1.6)
    assert result["recompute_cost"] == pytest.approx(0.25)
    # 0.9 s of the 2.5 s serial step hidden, of min(generate 1.0, update 1.5) = 1.0 that could be
    assert result["hidden_s"] == pytest.approx(0.9) and result["overlap"] == pytest.approx(0.9)
    assert result["variants"]["async1"]["overrides"] == ["run.async.max_staleness=1", "train.rollout_correction=tis"]


def test_a_direct_preference_summary_takes_the_synchronous_step_as_the_serial_work():
    runs = {"sync": [_run([20.0, 2.0, 2.0], 1.0, 1.0)], "async1": [_run([16.0, 1.5, 1.5], 1.0, 1.0)]}
    variants = async_shapes.DIRECT_PREFERENCE_VARIANTS
    result = async_shapes.summary("c", [], runs, images=64, warmup=1, variants_run=variants)
    assert result["gain"] == pytest.approx(2.0 / 1.5) and result["recompute_cost"] is None
    assert result["hidden_s"] == pytest.approx(0.5) and result["overlap"] == pytest.approx(0.5)  # of min(1.0, 1.0)
    assert result["variants"]["async1"]["overrides"] == ["run.async.max_staleness=1"]  # no rollout correction
    assert async_shapes.variants_for("shapes_flow_grpo", ["algorithm=diffusion_nft"]) is variants
    assert async_shapes.variants_for("shapes_flow_grpo", []) is async_shapes.VARIANTS
