"""Smoke tests of benchmarks/train_e2e.py (`diffrl train` against the engines-only loop) and benchmarks/run_bytes.py
(bytes on disk before and after retention), on the CPU with tiny sizes."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from benchmarks import run_bytes, train_e2e

TINY = [  # the whole-flow tests' sizes (tests/e2e/e2e_settings.py), FlowGRPO
    "model.path=tiny:sd3",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.train=generator:ocr",
    "data.val=null",
    "rollout.max_sequence_length=null",
    "rollout.num_inference_steps=2",
    "rollout.height=32",
    "rollout.width=32",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.chunk_size=4",
    "rollout.batch_size=8",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=8",
    "data.num_generated=16",
    "data.num_val_prompts=2",
    "algorithm={name: flow_grpo, kl_coef: 0.0}",
]


@pytest.mark.slow  # ~40 s on 2 cores: a whole `diffrl train` in a subprocess, then the engines
def test_train_e2e_compares_the_flow_with_the_engines_on_one_config(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "result.json"
    common = ["--config", "quickstart", *TINY, "--steps", "3", "--warmup", "1"]
    # in two calls, as for a model too large for both runs in one device call: the flow, then the engines
    # the first call's own JSON (`--flow-only --out`): the flow's figures alone
    flow = train_e2e.main([*common, "--flow-only", "--keep", str(tmp_path / "work"), "--out", str(tmp_path / "f.json")])
    assert os.path.exists(tmp_path / "work" / "mlflow.db") and not os.path.exists(tmp_path / "work" / "engines-runs")
    assert json.loads((tmp_path / "f.json").read_text())["flow_seconds_per_step"] == flow["flow_seconds_per_step"]
    # per step, samples / seconds on 1 GPU; the figures are medians of the timed steps 2 and 3 (the warm-up left out).
    # Not 8 / median(seconds): the median of two rates is their mean, which a loaded machine's uneven steps moved
    # more than the 20 % this test allowed (a mean of reciprocals against a reciprocal of the mean)
    seconds, rates = (flow["flow_stages_each"][key] for key in ("perf/time_per_step", "perf/throughput"))
    assert len(seconds) == 3 and rates == pytest.approx([8 / s for s in seconds], rel=1e-9)
    assert flow["flow_seconds_per_step"] == pytest.approx(statistics.median(seconds[1:]), rel=1e-12)
    assert flow["flow_samples_per_gpu_s"] == pytest.approx(statistics.median(rates[1:]), rel=1e-12)
    assert len(flow["flow_stages_each"]["timing_s/generate"]) == 3 and "flow_over_engine" not in flow
    result = train_e2e.main([*common, "--flow-from", str(tmp_path / "work"), "--out", str(out)])
    assert result["flow_seconds_per_step"] == flow["flow_seconds_per_step"]  # the same run, read again
    assert json.loads(out.read_text())["flow_over_engine"] == result["flow_over_engine"]
    assert result["flow_over_engine"] == pytest.approx(
        result["flow_seconds_per_step"] / result["engine_seconds_per_step"]
    )
    assert result["images_per_step"] == 8 and result["flow_images_per_gpu_s"] == pytest.approx(
        8 / result["flow_seconds_per_step"]
    )
    # the same step core on the same seeds: both runs saw the same rewards
    assert result["flow_reward_each"] == pytest.approx(result["engine_reward_each"], rel=1e-6)
    assert result["run_folder_bytes"]["trajectories.lance"] > 0 and result["bytes_per_sample"] > 0
    assert set(result["startup_s"]) >= {"imports", "prefect", "engines", "loggers", "validation", "total"}
    assert not os.path.exists(tmp_path / "work" / "engines-runs")  # the engines write nothing


def test_run_bytes_keeps_only_the_last_steps_latents(tmp_path, monkeypatch):
    """With old versions deleted at once (the flow waits 10 s for readers; this test does not)."""
    import diffrl.engines.step.retention

    monkeypatch.setattr(run_bytes, "KEEP_VERSIONS_S", 0.0)
    monkeypatch.setattr(diffrl.engines.step.retention, "KEEP_VERSIONS_S", 0.0)
    out = tmp_path / "bytes.json"
    result = run_bytes.main(
        ["--layout", "shapes", "--samples", "8", "--steps", "6", "--compact-every", "3", "--out", str(out)]
    )
    latents_per_step = 8 * 5 * 4 * 64 * 64 * 4  # samples x (window + 1) x S x fp32
    before, after = result["before"], result["after"]
    assert before["bytes"] > 6 * latents_per_step  # every step's latents stay
    assert after["bytes"] < 4 * latents_per_step  # the last 2 steps' (and the step in flight's)
    assert json.loads(out.read_text())["after"] == after


def test_repeats_pair_each_flow_run_with_its_engines_run_so_they_cannot_split_over_calls(tmp_path):
    for args in (["--repeats", "2", "--flow-only", "--keep", str(tmp_path)], ["--repeats", "0"]):
        with pytest.raises(SystemExit, match="--repeats must be >= 1"):
            train_e2e.main(["--config", "quickstart", *args])


@pytest.mark.slow  # ~35 s on the loaded 2-core machine (a tiny Wan2.2 built, 2 steps)
def test_engines_only_video_run_records_videos_and_frames_per_gpu_s(tmp_path, monkeypatch):
    """`--engines-only` on the shipped Wan2.2 DanceGRPO recipe (the tiny two-expert Wan2.2, 5 frames): videos and
    frames per GPU per second from the step's seconds, and with --trace the rollout's denoise and decode apart."""
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "video.json"
    tiny_wan22 = [
        "model.path=tiny:wan22",
        "model.dtype=fp32",
        "reward.components=[{name: jpeg_compressibility}]",
        "data.val=null",
        "data.num_generated=8",
        "data.num_val_prompts=0",
        "rollout.num_inference_steps=4",
        "rollout.height=16",
        "rollout.width=16",
        "rollout.num_frames=5",
        "rollout.max_sequence_length=16",
        "rollout.group_size=2",
        "rollout.prompts_per_step=1",
        "rollout.chunk_size=2",
        "rollout.batch_size=2",
        "train.lora_rank=4",
        "train.lora_alpha=8",
        "train.mini_batch_prompts=1",
        "train.micro_batch_size=2",
        "train.gradient_checkpointing=false",
    ]
    argv = ["--config", "wan22_dance_grpo", *tiny_wan22, "--steps", "2", "--warmup", "1", "--engines-only"]
    result = train_e2e.main([*argv, "--trace", "--keep", str(tmp_path / "work"), "--out", str(out)])
    written = json.loads(out.read_text())  # rewritten after every step; the last write is the whole run's
    assert written["videos_per_gpu_s"] == result["videos_per_gpu_s"] and written["complete"] is True
    assert result["steps_done"] == 2
    seconds = result["engine_seconds_per_step"]
    assert seconds == result["engine_seconds_each"][1]  # the one timed step
    assert (result["videos_per_step"], result["frames_per_video"]) == (2, 5)
    assert result["videos_per_gpu_s"] == pytest.approx(2 / seconds)
    assert result["frames_per_gpu_s"] == pytest.approx(2 * 5 / seconds)
    assert result["engine_images_per_gpu_s"] == pytest.approx(result["videos_per_gpu_s"])
    bars = result["engine_trace_s"]
    assert bars["denoise"]["count"] == bars["decode"]["count"] == 2  # one chunk a step, two steps
    assert bars["denoise"]["per_step_s"] > 0 and bars["decode"]["per_step_s"] > 0 and "update_actor" in bars
    assert "flow_seconds_per_step" not in result and not os.path.exists(tmp_path / "work" / "mlflow.db")
    for key in ("timing_s/generate", "timing_s/update_actor", "perf/time_per_step"):
        assert result["engine_stage_medians_s"][key] > 0, key
    assert result["peak_memory_allocated_gib"] is None  # CPU: no CUDA peak to record


def test_a_partial_engines_only_record_has_no_rate_until_a_timed_step_ran():
    """The record written after the warm-up step of a call stopped at its limit: the steps it ran, no medians yet."""
    import argparse

    from diffrl.configs.schema import load_experiment

    cfg = load_experiment(
        "wan22_dance_grpo", ["rollout.group_size=2", "rollout.prompts_per_step=1", "train.mini_batch_prompts=1"]
    )
    args = argparse.Namespace(config="wan22_dance_grpo", overrides=[], steps=2, warmup=1)
    step = dict.fromkeys(train_e2e.STAGE_KEYS, 1.0) | {"perf/time_per_step": 120.0}
    partial = train_e2e.engines_json(args, cfg, {"build_seconds": 9.0, "per_step": [step]}, None, [], complete=False)
    assert (partial["complete"], partial["steps_done"], partial["engine_seconds_per_step"]) == (False, 1, None)
    assert partial["engine_images_per_gpu_s"] is None and "videos_per_gpu_s" not in partial
    assert partial["engine_seconds_each"] == [120.0] and partial["peak_memory_allocated_gib"] == 1.0
    done = train_e2e.engines_json(args, cfg, {"build_seconds": 9.0, "per_step": [step, step]}, None, [], complete=True)
    assert done["videos_per_gpu_s"] == pytest.approx(2 / 120.0)
    assert done["frames_per_gpu_s"] == pytest.approx(2 * 33 / 120.0)  # the recipe's 33 frames
