"""benchmarks/scaling.py's result: speedup, efficiency and `scaling` (the speedup at 2 GPUs, the efficiency at
8), from the runs' per-step times (its reading of a real replicated run's stage records is checked in
tests/cluster/test_replicas.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from benchmarks import scaling


def _run(seconds: float, steps: int = 4) -> dict:
    """A finished run as run_flow returns it: every step `seconds` but the first (compile) 10x as long."""
    times = {s: seconds * (10 if s == 1 else 1) for s in range(1, steps + 1)}
    return {
        "per_step": {"perf/time_per_step": times, "critic/rewards/mean": dict.fromkeys(times, 0.5)},
        "replicas": {},
        "startup_s": {},
    }


def _header(machine_gpus: int, gpus: list[int]) -> dict:
    return dict(config="c", overrides=[], device="d", machine_gpus=machine_gpus, gpus=gpus, steps=4, warmup=1)


def test_eight_gpus_scaling_is_the_efficiency_at_the_largest_count():
    runs = {1: _run(2.0), 2: _run(1.0), 4: _run(0.625), 8: _run(0.4)}
    result = scaling.summary({**_header(8, [1, 2, 4, 8]), "images_per_step": 32}, runs, warmup=1, steps=4)
    assert result["by_gpus"]["1"]["images_per_s"] == pytest.approx(16.0)  # 32 images in 2 s, warm-up step left out
    assert result["by_gpus"]["8"]["images_per_gpu_s"] == pytest.approx(80 / 8)
    assert result["speedup"] == pytest.approx({"1": 1.0, "2": 2.0, "4": 3.2, "8": 5.0})
    assert result["efficiency"] == pytest.approx({"1": 1.0, "2": 1.0, "4": 0.8, "8": 0.625})
    assert result["scaling"] == pytest.approx(0.625) and result["scaling_is"] == "efficiency at 8 GPUs (issue 35)"


def test_two_gpus_scaling_is_the_speedup_and_a_failed_run_is_kept_as_its_error():
    runs = {1: _run(2.0), 2: _run(1.05), 4: {"error": "diffrl train exited with 1"}}
    result = scaling.summary({**_header(2, [1, 2]), "images_per_step": 32}, runs, warmup=1, steps=4)
    assert result["scaling"] == pytest.approx(2.0 / 1.05) and result["scaling_is"] == "speedup at 2 GPUs (issue 39)"
    assert result["by_gpus"]["4"] == {"error": "diffrl train exited with 1"} and "4" not in result["speedup"]
    assert result["by_gpus"]["2"]["seconds_each"] == [10.5, 1.05, 1.05, 1.05]


def test_per_replica_sums_a_replicas_chunks_and_takes_medians_over_the_timed_steps():
    """Replica r generated chunks 2r and 2r+1 of each step (diffrl/engines/step/plan.replica_chunks)."""

    def step(seconds: list[float], update: list[float], peak: list[float]) -> dict:
        return {
            "generate": [{"chunk": c, "seconds": s} for c, s in enumerate(seconds)],
            "update_actor": [
                {"metrics": {"timing_s/update_actor": u, "perf/max_memory_allocated_gb": p}}
                for u, p in zip(update, peak)
            ],
            "sync_weights": [{"metrics": {"timing_s/sync_weights": 0.1}} for _ in update],
        }

    steps = {
        0: step([9, 9, 9, 9], [9, 9], [1, 1]),
        1: step([1, 2, 3, 5], [4, 6], [10, 12]),
        2: step([1, 2, 3, 7], [4, 8], [11, 12]),
    }
    records = {stage: {s: steps[s][stage] for s in steps} for stage in ("generate", "update_actor", "sync_weights")}
    out = scaling.per_replica(records, 2, range(2, 4))  # MLflow steps 2 and 3: indices 1 and 2
    assert out["generate"] == [3.0, 9.0]  # replica 1: 3+5 and 3+7, median 9 (straggler)
    assert out["update_actor"] == [4.0, 7.0] and out["sync_weights"] == [0.1, 0.1]
    assert out["peak_memory_allocated_gb"] == [11, 12]  # over every step
