"""Asynchronous off-policy training (run.async) of a token run: `omni_quick` (the Qwen3-Omni Thinker warm start, GRPO,
exact-match reward) with LoRA at a tiny size on the CPU. max_staleness 0 is the synchronous run bit for bit; a
one-step-off run through `diffrl train` trains every step, logs async/* and the correction's ratios, and records in
each row the policy version that sampled it."""

from __future__ import annotations

import lance
import pytest
import torch
from mlflow.tracking import MlflowClient
from test_async_train import ONE_STEP_OFF, engines_only

from diffrl.flows.cli import main

# 2 questions x 4 answers a step in 2 chunks, 2 held-out questions; LoRA (the behaviour copy owns its LoRA tensors)
SMALL = [
    "run.steps=3",
    "run.checkpoint_every=2",
    "run.log_images=2",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.chunk_size=4",
    "rollout.batch_size=4",
    "train.mini_batch_prompts=2",
    "train.micro_batch_size=8",
    "train.lora=true",
    "train.lr=3e-2",
    "data.num_generated=32",
    "data.num_val_prompts=2",
]


def test_max_staleness_0_is_the_synchronous_token_run_bit_for_bit(workdir):
    before, before_weights = engines_only("omni_quick", SMALL, "sync")
    after, after_weights = engines_only("omni_quick", [*SMALL, "run.async.max_staleness=0"], "async-0")
    for key in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
        assert [m[key] for m in before] == [m[key] for m in after], key
    assert sorted(before_weights) == sorted(after_weights)
    assert any(v.abs().max() > 0 for k, v in before_weights.items() if "lora_B" in k)  # the LoRA moved
    for name, value in before_weights.items():
        assert torch.equal(value, after_weights[name]), name
    assert not any(k.startswith("async/") for m in after for k in m)  # the synchronous step, as before


def test_one_step_off_token_run_records_versions_and_logs_staleness(workdir):
    assert main(["train", "omni_quick", *SMALL, *ONE_STEP_OFF]) == 0
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-omni").experiment_id])
    assert run.info.status == "FINISHED"

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    # step 1 samples at version 0 and trains at 0; step 2's rollout ran beside step 1's update, on the behaviour
    # copy at version 0, and trains at 1; step 3's ran beside step 2's, at 1, and trains at 2
    assert history("async/staleness_max") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert history("async/dropped") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert [s for s, _ in history("timing_s/sync_rollout_wait")] == [1, 2, 3]
    assert [v for _, v in history("sync/num_tensors")][0] > 0  # the LoRA tensors went into the behaviour copy
    for key in ("rollout_corr/ratio_mean", "rollout_corr/ratio_max", "rollout_corr/ratio_corrected"):
        assert [s for s, _ in history(key)] == [1, 2, 3], key
    ratio_at_staleness_0 = history("rollout_corr/ratio_mean")[0][1]
    assert ratio_at_staleness_0 == pytest.approx(1.0, abs=1e-5)  # the proximal policy is the behaviour one
    assert history("rollout_corr/ratio_mean")[1][1] != pytest.approx(1.0, abs=1e-6)  # one version behind
    rows = lance.dataset(f"{workdir}/runs/omni-quick/trajectories.lance").to_table(columns=["step", "policy_version"])
    pairs = set(zip(rows.column("step").to_pylist(), rows.column("policy_version").to_pylist()))
    assert pairs == {(1, 0), (2, 0), (3, 1)}  # (step number, the policy version that sampled it)
    assert rows.num_rows == 3 * 8  # every row once


def test_a_one_step_off_token_run_failed_in_its_update_runs_again_from_it(workdir, monkeypatch):
    """Step 3's update fails after its rows were stored (they were sampled beside step 2's update); the same command
    goes on from that stage: step 3's stored rows are kept, every row stored once, each step at one policy version,
    every step trained and logged once. (A kill -9 of a one-step-off run is tests/e2e/test_async_train.py's: the
    rows, checkpoints and their writer are the same for both families.)"""
    args = ["train", "omni_quick", *SMALL, *ONE_STEP_OFF]
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "update_actor@3")
    assert main(args) != 0
    table = f"{workdir}/runs/omni-quick/trajectories.lance"
    before = lance.dataset(table).to_table(filter="step = 3", columns=["write_id"]).column("write_id").to_pylist()
    assert len(before) == 8
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    assert main(args) == 0
    rows = lance.dataset(table).to_table(columns=["step", "group_id", "sample_index", "policy_version", "write_id"])
    steps = rows.column("step").to_pylist()
    assert sorted(w for s, w in zip(steps, rows.column("write_id").to_pylist()) if s == 3) == sorted(before)
    keys = list(zip(*(rows.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == 3 * 8  # each step's rows once
    assert set(zip(steps, rows.column("policy_version").to_pylist())) == {(1, 0), (2, 0), (3, 1)}
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-omni").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("actor/grad_norm", "async/staleness_max"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3], key
