"""Smoke test of benchmarks/shapes_rl.py: the shapes RL loop (engines only) on the CPU with the quickstart's
shipped model (reference:shapes-small), cut to one tiny step, and the per-category JSON it records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import shapes_rl
from diffrl.shapes.scenes import TAGS  # noqa: E402


@pytest.mark.slow  # ~15 s on 2 cores
def test_shapes_rl_records_accuracy_per_category_before_and_after(tmp_path):
    """The policy-gradient path (PolicyTrainer): FlowGRPO in place of the quickstart's DiffusionNFT."""
    result = shapes_rl.main(
        [
            "--config",
            "quickstart",
            "run.steps=1",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.batch_size=8",
            "rollout.chunk_size=8",
            "train.mini_batch_prompts=2",
            "train.micro_batch_size=8",
            "data.num_val_prompts=12",
            "data.val_samples_per_prompt=1",
            "algorithm={name: flow_grpo, kl_coef: 0.0}",
            "--out-dir",
            str(tmp_path),
        ]
    )
    recorded = json.loads((tmp_path / "shapes_rl_quickstart_cpu.json").read_text())
    assert recorded["before"] == result["before"] and recorded["samples_per_step"] == 8
    assert [h["step"] for h in recorded["history"]] == [0, 1]
    # the first 12 held-out prompts cover every category (2 each); overall = mean of the categories here
    for when in ("before", "after"):
        per_tag = [recorded[when][f"accuracy/{t}"] for t in TAGS]
        assert recorded[when]["accuracy"] == pytest.approx(sum(per_tag) / len(per_tag))
        assert 0.0 <= recorded[when]["reward"] <= 1.0
    assert len(recorded["train_reward_curve"]) == 1
    assert (tmp_path / "shapes_rl_quickstart_cpu.png").stat().st_size > 0


def test_shapes_rl_refuses_a_non_shapes_config():
    with pytest.raises(SystemExit, match="shapes_rl drives shapes configs"):
        shapes_rl.main(["--config", os.path.join(os.path.dirname(__file__), "..", "configs", "quick_dpo.yaml")])


@pytest.mark.slow  # ~15 s on 2 cores
def test_shapes_rl_trains_diffusion_nft_and_records_per_step_metrics(tmp_path):
    """The direct-preference path (the quickstart's DiffusionNFT: the PolicyTrainer on final samples, rollouts with
    the old adapter) and a tagged file."""
    shapes_rl.main(
        [
            "--config",
            "quickstart",
            "run.steps=1",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            "rollout.batch_size=8",
            "rollout.chunk_size=8",
            "train.mini_batch_prompts=2",
            "train.micro_batch_size=8",
            "data.num_val_prompts=6",
            "data.val_samples_per_prompt=1",
            "--tag",
            "nft",
            "--out-dir",
            str(tmp_path),
        ]
    )
    recorded = json.loads((tmp_path / "shapes_rl_quickstart_nft_cpu.json").read_text())
    (step,) = recorded["train_metrics"]
    assert step["reward"] == pytest.approx(recorded["train_reward_curve"][0])
    assert 0.0 <= step["accuracy"] <= 1.0 and step["rollout_s"] > 0
    assert step["actor/old_deviate"] >= 0.0 and step["actor/grad_norm"] > 0.0  # NFT's own metric: it trained


@pytest.mark.slow  # ~10 s on 2 cores
def test_shapes_rl_eval_only_also_evaluates_other_sampling_settings(tmp_path):
    """--eval-only trains nothing; --eval-also repeats the held-out evaluation at other sampling settings, and
    the config's own setting given again reproduces the main evaluation exactly (same prompts and seeds)."""
    result = shapes_rl.main(
        [
            "--config",
            "quickstart",
            "data.num_val_prompts=6",
            "data.val_samples_per_prompt=1",
            "--eval-only",
            "--eval-also",
            "guidance_scale=1,num_inference_steps=4",
            "guidance_scale=4.5",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert result["steps"] == 0 and result["train_reward_curve"] == [] and len(result["history"]) == 1
    assert result["seconds_per_step_median"] is None
    also = result["at_other_sampling"]
    assert set(also) == {"before"}
    assert set(also["before"]) == {"guidance_scale=1,num_inference_steps=4", "guidance_scale=4.5"}
    own = {k: v for k, v in result["before"].items() if k != "step"}
    assert also["before"]["guidance_scale=1,num_inference_steps=4"] == own  # quickstart's own setting
    assert 0.0 <= also["before"]["guidance_scale=4.5"]["reward"] <= 1.0
    for bad in ("eta=1", "num_inference_steps=ten"):
        with pytest.raises(SystemExit, match="--eval-also takes"):
            shapes_rl.main(["--config", "quickstart", "--eval-only", "--eval-also", bad, "--out-dir", str(tmp_path)])


def test_shapes_rl_evaluates_at_fewer_steps_than_the_sde_window(tmp_path):
    """shapes_quick's SDE window covers all 4 steps; an ODE evaluation at 2 steps needs no window and must not
    fail on it ("WindowPolicy.size 4 > num_steps 2"). 2 steps sample worse than 4 on this model."""
    result = shapes_rl.main(
        [
            "--config",
            "shapes_quick",
            "data.num_val_prompts=12",
            "data.val_samples_per_prompt=1",
            "--eval-only",
            "--eval-also",
            "num_inference_steps=2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    two_steps = result["at_other_sampling"]["before"]["num_inference_steps=2"]
    assert 0.0 <= two_steps["reward"] < result["before"]["reward"]


@pytest.mark.slow  # ~8 s on 2 cores
def test_a_run_killed_after_a_validation_keeps_its_record(tmp_path):
    """The result file is rewritten after every validation: a run killed (SIGKILL, as a timeout does) right after
    its step-1 validation leaves a readable record of steps 0 and 1 marked unfinished; a whole run marks it
    finished."""
    tiny = [
        "run.steps=50",
        "run.validate_every=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.batch_size=8",
        "rollout.chunk_size=8",
        "train.mini_batch_prompts=2",
        "train.micro_batch_size=8",
        "data.num_val_prompts=6",
        "data.val_samples_per_prompt=1",
    ]
    repo = os.path.join(os.path.dirname(__file__), "..", "..")
    run = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.shapes_rl", "--config", "shapes_quick", *tiny, "--out-dir", str(tmp_path)],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for line in run.stdout:
            if line.startswith('{"step": 1,'):
                break
        else:
            pytest.fail(f"shapes_rl.py ended (rc {run.wait()}) before its step-1 validation")
    finally:
        run.kill()
        run.wait(timeout=30)
    recorded = json.loads((tmp_path / "shapes_rl_shapes_quick_cpu.json").read_text())
    assert recorded["finished"] is False and [h["step"] for h in recorded["history"]] == [0, 1]
    assert len(recorded["train_reward_curve"]) == 1 and recorded["after"] == recorded["history"][1]
    assert recorded["after"] == json.loads(line)
    assert not (tmp_path / "shapes_rl_shapes_quick_cpu.json.tmp").exists()

    whole = shapes_rl.main(["--config", "shapes_quick", *tiny, "run.steps=1", "--out-dir", str(tmp_path)])
    assert whole["finished"] is True
    assert json.loads((tmp_path / "shapes_rl_shapes_quick_cpu.json").read_text())["finished"] is True
