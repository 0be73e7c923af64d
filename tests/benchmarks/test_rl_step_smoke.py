"""Smoke test of benchmarks/rl_step.py: the whole RL step through the step core (generate -> score -> advantages
-> update_actor -> sync_weights) on tiny random models on the CPU, and the JSON it records."""

from __future__ import annotations

import json

import pytest

from benchmarks import rl_step
from diffrl.configs.schema import load_experiment


@pytest.mark.slow  # ~20 s of CPU time per recipe (longer wall time on a loaded machine)
@pytest.mark.parametrize("recipe", ["sd35m_flow_grpo", "qwen_image_ocr_lora"])
def test_rl_step_tiny_cpu_writes_result(tmp_path, recipe):
    out = tmp_path / "result.json"
    result = rl_step.main(
        [
            "--recipe",
            recipe,
            "--tiny",
            "--device",
            "cpu",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--variants",
            "recompute_old_log_probs",
            "--out",
            str(out),
        ]
    )
    recorded = json.loads(out.read_text())
    assert recorded["images_per_gpu_s"] == pytest.approx(result["images_per_gpu_s"])
    main = recorded["main"]
    assert main["images_per_step"] == 2  # tiny: one prompt x group of 2
    stages = main["stage_seconds"]
    # a step's seconds as a run sees them (end of one step to the end of the next): at least its rollout and
    # update, which run one after the other (the reward is streamed behind the rollout)
    assert main["seconds_per_step"] == pytest.approx(stages["step"])
    assert main["seconds_per_step"] >= stages["rollout"] + stages["update"]
    assert recorded["images_per_gpu_s"] == pytest.approx(2 / main["seconds_per_step"])
    assert recorded["flops"]["forward_flops_per_image"] > 0
    # fp32 on the CPU: the rollout's log-probs are the replay's, so skipping the recompute is exact.
    assert main["logprob_gap_mean"] < 1e-4
    variant = recorded["variants"][0]
    assert variant["name"] == "recompute_old_log_probs" and variant["levers"]["old_log_probs"] == "recompute"
    # The recompute adds one no-grad forward per trained step to the FLOP count.
    assert variant["achieved_tflops"] / variant["images_per_gpu_s"] > main["achieved_tflops"] / main["images_per_gpu_s"]


def test_rl_step_rejects_unknown_variant():
    with pytest.raises(ValueError, match="--variants"):
        rl_step.parse_args(["--recipe", "sd35m_flow_grpo", "--variants", "warp_speed"])


def test_rl_step_ode_shortcut_levers():
    args = rl_step.parse_args(["--recipe", "qwen_image_ocr_lora", "--ode-tail", "dpm2m:3"])
    assert rl_step.ode_shortcut(args.ode_tail) == rl_step.OdeShortcut("dpm2m", 3)
    assert not rl_step.ode_shortcut(args.ode_head).on
    with pytest.raises(ValueError, match="SOLVER:EVALUATIONS"):
        rl_step.parse_args(["--recipe", "sd35m_flow_grpo", "--ode-tail", "dpm2m"])
    with pytest.raises(ValueError, match=r"solver must be 'none' \(off\) or one of"):
        rl_step.parse_args(["--recipe", "sd35m_flow_grpo", "--ode-head", "heun:2"])


@pytest.mark.slow  # ~20 s of CPU time
def test_rl_step_tiny_cpu_weights_variant(tmp_path):
    out = tmp_path / "result.json"
    argv = ["--recipe", "sd35m_flow_grpo", "--tiny", "--device", "cpu", "--warmup", "0", "--steps", "1"]
    rl_step.main([*argv, "--variants", "weights_fp8,weights_fp8_deterministic", "--out", str(out)])
    recorded = json.loads(out.read_text())
    fp8, deterministic = recorded["variants"]
    assert fp8["levers"]["weights"] == "fp8" and deterministic["levers"]["weights"] == "fp8:deterministic"
    assert fp8["images_per_gpu_s"] > 0 and deterministic["images_per_gpu_s"] > 0
    # fp8 in the window: old log-probs recomputed, their gap to the rollout's measured; deterministic: the window ran
    # the trainer's numerics (fp32 on the CPU), so the gap is that of the main levers
    assert fp8["logprob_gap_mean"] > 1e-4 and deterministic["logprob_gap_mean"] < 1e-4


def test_rl_step_weights_lever():
    args = rl_step.parse_args(["--recipe", "qwen_image_ocr_lora", "--weights", "fp8:deterministic"])
    assert rl_step.rollout_weights(args.weights) == rl_step.RolloutWeights("fp8", "deterministic")
    assert rl_step.rollout_weights("merged") == rl_step.RolloutWeights("merged", "all")
    assert list(rl_step.VARIANTS)[-1] == "compile"
    with pytest.raises(ValueError, match="weights.kind must be one of"):
        rl_step.parse_args(["--recipe", "sd35m_flow_grpo", "--weights", "int4"])


@pytest.mark.slow  # ~20 s of CPU time
def test_rl_step_tiny_cpu_sort_by_window_variant(tmp_path):
    out = tmp_path / "result.json"
    argv = ["--recipe", "qwen_image_ocr_lora", "--tiny", "--device", "cpu", "--warmup", "0", "--steps", "1"]
    # the recipe sorts by window start (as its YAML does); the variant times the unsorted batches against it
    rl_step.main([*argv, "--prompts", "2", "--variants", "sort_by_window,unsorted", "--out", str(out)])
    recorded = json.loads(out.read_text())
    same, variant = recorded["variants"]
    assert recorded["main"]["images_per_step"] == 4  # --prompts 2: two groups of 2, in two forward batches of 2
    assert same == {"name": "sort_by_window", "skipped": "same as the main levers"}
    assert variant["name"] == "unsorted" and variant["levers"]["sort_by_window"] is False
    assert recorded["main"]["levers"]["sort_by_window"] is True
    assert variant["warmup_steps"] == 1 and variant["images_per_gpu_s"] > 0  # a rollout lever: one warm-up step
    # tiny: 4 steps, so no tail is ever shortened (a tail of at most 2 steps, K = 2): the same evaluations
    assert variant["rollout_evaluations_per_image"] == recorded["main"]["rollout_evaluations_per_image"]


def test_rl_step_prompts_must_be_positive():
    with pytest.raises(ValueError, match="--prompts must be >= 1"):
        rl_step.parse_args(["--recipe", "qwen_image_ocr_lora", "--quick", "--prompts", "0"])


def test_rl_step_sort_by_window_lever():
    """The main levers take rollout.sort_by_window from the recipe, as its YAML sets it, unless the flag says."""
    assert rl_step.RECIPES["qwen_image_ocr_lora"].sort_by_window is True
    assert load_experiment("qwen_image_ocr_lora").sampling.sort_by_window is True
    assert rl_step.RECIPES["sd35m_flow_grpo"].sort_by_window is False
    assert rl_step.parse_args(["--recipe", "qwen_image_ocr_lora"]).sort_by_window is None
    assert rl_step.parse_args(["--recipe", "qwen_image_ocr_lora", "--sort-by-window", "off"]).sort_by_window == "off"
    with pytest.raises(SystemExit):
        rl_step.parse_args(["--recipe", "qwen_image_ocr_lora", "--sort-by-window", "yes"])
    names = list(rl_step.VARIANTS)
    assert names.index("sort_by_window") < names.index("compile") == len(names) - 1


def test_variant_counts_its_own_evaluations_when_it_changes_the_sampler():
    """A variant that sorts the rows (or changes an ODE shortcut) samples with fewer evaluations than main: its FLOPs
    count its own measured evaluations (counting main's 8.0 for its 6.25 would record an MFU of 0.52 for 0.44)."""
    main = rl_step.Levers(rollout_batch=16, micro_batch=4, checkpointing=0.0, ode_tail="ab2:2")
    main_phase = {"rollout_evaluations_per_image": 8.0}
    sorted_phase = {"rollout_evaluations_per_image": 6.25}
    sort = rl_step.dataclasses.replace(main, sort_by_window=True)
    assert rl_step.counted_phase(main_phase, sorted_phase, main, sort) is sorted_phase
    assert rl_step.shortcut_evaluations(rl_step.counted_phase(main_phase, sorted_phase, main, sort), sort) == 6.25
    # a variant that keeps main's sampler (e.g. another micro-batch) counts main's evaluations
    other = rl_step.dataclasses.replace(main, micro_batch=8)
    assert rl_step.counted_phase(main_phase, {"rollout_evaluations_per_image": 0.0}, main, other) is main_phase
