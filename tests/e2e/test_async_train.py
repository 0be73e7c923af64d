"""Asynchronous off-policy training (run.async) on the tiny SD3 on the CPU: max_staleness 0 is the synchronous run bit
for bit; a one-step-off run through `diffrl train` trains every step, logs async/* and (policy gradient) the
correction's ratios, and records in each row the policy version that sampled it. Both for FlowGRPO and for
DiffusionNFT (the direct-preference family, whose rollout samples with its EMA "old" adapter)."""

from __future__ import annotations

import lance
import pytest
import torch
from e2e_settings import TINY, TINY_SIZES
from mlflow.tracking import MlflowClient

from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.engines.step.run import DirectStages, run_step
from diffrl.engines.train.checkpoint import trainable_state
from diffrl.flows.build import build_engines
from diffrl.flows.cli import main

ONE_STEP_OFF = ["run.async.max_staleness=1", "train.rollout_correction=tis"]


def _history_of_the_run(workdir):
    """A function of a metric's key: the (step, value) history of the run's one MLflow run."""
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])[0]

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    return history


def _assert_one_step_off(history) -> None:
    """Step 1 samples at version 0 and trains at 0; step 2's rollout ran beside step 1's update, on the behaviour copy
    at version 0, and trains at 1; step 3's ran beside step 2's, at 1, and trains at 2; nothing dropped."""
    assert history("async/staleness_max") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert history("async/staleness_mean") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert history("async/dropped") == [(1, 0.0), (2, 0.0), (3, 0.0)]


# the quickstart's DiffusionNFT at TINY's sizes, its window the last of the 2 denoising steps (it trains on x0)
TINY_NFT = TINY_SIZES + ["algorithm.window={kind: random_start, size: 1, start_range: [1, 2]}"]


def engines_only(config: str | None, overrides: list[str], name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Every step of a run through the step core (no Prefect): each step's metrics, then the trained tensors."""
    cfg = load_experiment(config, overrides + [f"run.name={name}"])
    engines = build_engines(cfg, durable=False)
    try:
        stages = DirectStages(engines)
        metrics = [run_step(engines, step, stages).metrics for step in range(cfg.run.steps)]
        engines.memory.drain()
        return metrics, trainable_state(engines.trainer, all_lora=True)
    finally:
        cluster.drop(name)


@pytest.mark.parametrize(
    ("tiny", "loss"),
    [(TINY, "actor/pg_loss"), (TINY_NFT, "actor/positive_loss")],
    ids=["flow_grpo", "diffusion_nft"],
)
def test_max_staleness_0_is_the_synchronous_run_bit_for_bit(workdir, tiny, loss):
    before, before_weights = engines_only(None, tiny, "sync")
    after, after_weights = engines_only(None, [*tiny, "run.async.max_staleness=0"], "async-0")
    for key in ("critic/rewards/mean", loss, "actor/grad_norm"):
        assert [m[key] for m in before] == [m[key] for m in after], key
    assert sorted(before_weights) == sorted(after_weights)
    for name, value in before_weights.items():
        assert torch.equal(value, after_weights[name]), name
    assert not any(k.startswith("async/") for m in after for k in m)  # the synchronous step, as before


@pytest.mark.parametrize("algorithm", [[], ["algorithm=gardo"]], ids=["flow_grpo", "gardo"])
def test_one_step_off_run_records_versions_and_logs_staleness(workdir, algorithm):
    """GARDO's reference is its "old" adapter, which the behaviour copy owns as the policy's LoRA."""
    assert main(["train", *TINY, *algorithm, *ONE_STEP_OFF]) == 0
    history = _history_of_the_run(workdir)
    _assert_one_step_off(history)
    for key in ("rollout_corr/ratio_mean", "rollout_corr/ratio_max", "rollout_corr/ratio_corrected"):
        assert [s for s, _ in history(key)] == [1, 2, 3], key
    ratio_at_staleness_0 = history("rollout_corr/ratio_mean")[0][1]
    assert ratio_at_staleness_0 == pytest.approx(1.0, abs=1e-5)  # the proximal policy is the behaviour one
    rows = lance.dataset(f"{workdir}/runs/quickstart/trajectories.lance").to_table(columns=["step", "policy_version"])
    pairs = set(zip(rows.column("step").to_pylist(), rows.column("policy_version").to_pylist()))
    assert pairs == {(1, 0), (2, 0), (3, 1)}  # (step number, the policy version that sampled it)
    assert rows.num_rows == 3 * 8  # every row once


LAST_STEP = "{kind: random_start, size: 1, start_range: [1, 2]}"
# per direct-preference algorithm: its run at TINY's sizes, its loss metric, the rows a step trains (DPO: per group
# one (chosen, rejected) pair; the others: every sample)
DIRECT_PREFERENCE = {
    "diffusion_nft": (TINY_NFT, "actor/positive_loss", 8.0),
    "dpo": ([*TINY_SIZES, f"algorithm={{name: dpo, window: {LAST_STEP}}}"], "actor/dpo_loss", 4.0),
    "awm": ([*TINY_SIZES, f"algorithm={{name: awm, window: {LAST_STEP}}}"], "actor/fm_loss", 8.0),
    "dgpo": ([*TINY_SIZES, "algorithm=dgpo"], "actor/dsm_loss", 8.0),
}


@pytest.mark.parametrize("algorithm", sorted(DIRECT_PREFERENCE))
def test_one_step_off_direct_preference_run_trains_each_row_once_within_the_bound(workdir, algorithm):
    """One step off without a rollout correction (the loss has no ratio): the behaviour copy samples beside the update
    (DiffusionNFT with its own old adapter), and each step trains its own rows, of one policy version, once."""
    tiny, loss, trained_rows = DIRECT_PREFERENCE[algorithm]
    assert main(["train", *tiny, "run.async.max_staleness=1"]) == 0
    history = _history_of_the_run(workdir)
    _assert_one_step_off(history)
    assert history("dp/num_samples") == [(1, trained_rows), (2, trained_rows), (3, trained_rows)]
    assert [s for s, _ in history(loss)] == [1, 2, 3]
    assert history("sync/policy_version") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not history("rollout_corr/ratio_mean")  # nothing to correct: no behaviour log-probs in the loss
    rows = lance.dataset(f"{workdir}/runs/quickstart/trajectories.lance").to_table(
        columns=["step", "sample_index", "group_id", "policy_version"]
    )
    steps, versions = rows.column("step").to_pylist(), rows.column("policy_version").to_pylist()
    assert set(zip(steps, versions)) == {(1, 0), (2, 0), (3, 1)}  # one version per step, trained at most 1 later
    keys = list(zip(steps, rows.column("group_id").to_pylist(), rows.column("sample_index").to_pylist()))
    assert len(keys) == len(set(keys)) == 3 * 8  # every row once


@pytest.mark.slow
def test_a_killed_one_step_off_run_resumes_with_every_row_once_and_its_versions(workdir, capfd):
    """kill -9 in step 3's update, whose rows the behaviour copy sampled beside step 2's update; the same command
    resumes: every step's rows once, each with the version that sampled it, every step trained once, none staler
    than the limit."""
    from test_kill_resume import _diffrl, _rerun

    killed = _diffrl([*TINY, *ONE_STEP_OFF], workdir, DIFFRL_INJECT_FAULT="update_actor@3:exit")
    assert killed.returncode == 137, killed.stderr[-2000:]
    done = _rerun([*TINY, *ONE_STEP_OFF], capfd)
    # it resumes after the newest checkpoint that landed, or, when the background writer had landed none before
    # the kill (a loaded machine), runs the steps again whose writes did not land: rows once either way
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming after step" in done.stderr or "runs again from its first stage" in done.stderr
    rows = lance.dataset(f"{workdir}/runs/quickstart/trajectories.lance").to_table().to_pylist()
    counts = {s: sum(r["step"] == s for r in rows) for s in (1, 2, 3)}
    assert counts == {1: 8, 2: 8, 3: 8}  # each step's rows once
    versions = sorted({(r["step"], r["policy_version"]) for r in rows})
    # step 3's rows: those the behaviour copy sampled at version 1 beside step 2's update when they were stored before
    # the kill, else sampled again by the resumed run at step 2's checkpoint (version 2); one version either way
    assert versions in ([(1, 0), (2, 0), (3, 1)], [(1, 0), (2, 0), (3, 2)]), versions
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    staleness = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "async/staleness_max"))
    assert {s for s, _ in staleness} == {1, 2, 3} and all(v <= 1 for _, v in staleness)


@pytest.mark.parametrize("fault", ["update_actor@2", "sync_weights@2"])
def test_a_one_step_off_run_failed_in_a_stage_runs_again_from_it(workdir, monkeypatch, fault):
    """A stage of step 2 fails (its update starts step 3's rollout, its weight sync waits for it); the same command, as
    a rerun from the Prefect UI does, goes on from that stage: step 2's rows are the ones stored before the failure,
    every step is trained and logged once, every row stored once, each step at one policy version."""
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", fault)
    assert main(["train", *TINY, *ONE_STEP_OFF]) != 0
    table = f"{workdir}/runs/quickstart/trajectories.lance"
    before = lance.dataset(table).to_table(filter="step = 2", columns=["write_id"]).column("write_id").to_pylist()
    assert len(before) == 8
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    assert main(["train", *TINY, *ONE_STEP_OFF]) == 0
    rows = lance.dataset(table).to_table(columns=["step", "group_id", "sample_index", "policy_version", "write_id"])
    after = [w for s, w in zip(rows.column("step").to_pylist(), rows.column("write_id").to_pylist()) if s == 2]
    assert sorted(after) == sorted(before)  # step 2's rollout was not redone
    keys = list(zip(*(rows.column(c).to_pylist() for c in ("step", "group_id", "sample_index"))))
    assert len(keys) == len(set(keys)) == 3 * 8
    versions = sorted(set(zip(rows.column("step").to_pylist(), rows.column("policy_version").to_pylist())))
    assert [s for s, _ in versions] == [1, 2, 3] and versions[:2] == [(1, 0), (2, 0)]  # one version a step
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    for key in ("perf/time_per_step", "actor/grad_norm", "async/staleness_max"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3], key
