"""The step core through both of its callers: the Prefect flow (`diffrl train`) and the engines-only loop
(benchmarks), on the tiny SD3 model on the CPU. Same config and seeds: the same samples, rewards and weights."""

from __future__ import annotations

import glob
import os
from collections import Counter

import pytest
import torch
from e2e_settings import TINY as E2E_TINY
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster, trace
from diffrl.engines.step.plan import num_chunks
from diffrl.engines.step.records import Synced
from diffrl.engines.step.run import DirectStages, StepClock, add_perf, run_step, sync_engines
from diffrl.engines.train.checkpoint import trainable_state
from diffrl.flows.build import build_engines
from diffrl.flows.train import train

# the whole-flow tests' run, with 2 samples per rollout forward: each 4-sample chunk streams 2 sub-batches to the reward
TINY = E2E_TINY + ["rollout.batch_size=2"]


def _engines_only(overrides: list[str], name: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = load_experiment(None, TINY + overrides + [f"run.name={name}"])
    engines = build_engines(cfg, durable=False)
    try:
        stages, clock, metrics = DirectStages(engines), StepClock(), []
        for step in range(cfg.run.steps):
            metrics.append(add_perf(run_step(engines, step, stages).metrics, clock.lap()))
        engines.memory.drain()
        return metrics, trainable_state(engines.trainer, all_lora=True)
    finally:
        cluster.drop(name)


def test_the_flow_and_the_engines_only_loop_run_the_same_steps(workdir):
    """Rewards of every step (so the samples, and the weights that sampled them) and the final LoRA weights are
    bit-identical between `diffrl train`'s flow and the engines-only loop; only the flow writes anything."""
    train(config=None, overrides=TINY + ["run.name=flow", "run.trace=true"])
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])[0]
    flow_rewards = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "critic/rewards/mean")}
    flow_weights = load_file("runs/flow/checkpoints/step_3/trainable.safetensors")

    engine_metrics, engine_weights = _engines_only(["run.root=engines-only"], "engines-only")
    assert not os.path.exists("engines-only")  # no store, no checkpoints, nothing written
    assert [flow_rewards[s] for s in (1, 2, 3)] == pytest.approx(
        [m["critic/rewards/mean"] for m in engine_metrics], abs=0, rel=1e-6
    )
    assert sorted(flow_weights) == sorted(engine_weights)
    for name, value in engine_weights.items():
        assert torch.equal(flow_weights[name], value), name
    # every step after the first found its rollout started right after the previous step's weight sync
    assert [m["rollout/prefetched_chunks"] for m in engine_metrics] == [2, 2, 0]  # none after the last step
    assert all(m["perf/time_per_step"] > 0 and m["perf/throughput"] > 0 for m in engine_metrics)
    _check_trace(glob.glob("runs/flow/trace/*.json"), steps=3, chunks=2)


def _check_trace(paths: list[str], steps: int, chunks: int) -> None:
    """run.trace: the flow's timeline holds each stage run once per step (and chunk), by whichever thread ran it
    first (the flow's task or the run-ahead worker), each inside a Prefect task of that stage, and each step's
    subflow."""
    assert len(paths) == 1  # one process, one file
    bars = [e for e in trace.read(paths[0]) if e["ph"] == "X"]
    ran = Counter((e["name"], e["args"]["step"]) for e in bars if "step" in e.get("args", {}))
    for step in range(steps):
        assert ran[("step subflow", step)] == 1
        assert ran[("generate", step)] == ran[("score", step)] == ran[("task generate", step)] == chunks
        for stage in ("advantages", "update_actor", "sync_weights"):
            assert ran[(stage, step)] == ran[(f"task {stage}", step)] == 1, (stage, step)
    subflows = [e for e in bars if e["name"] == "step subflow"]
    for update in (e for e in bars if e["name"] == "update_actor"):
        step = update["args"]["step"]
        task = next(e for e in bars if e["name"] == "task update_actor" and e["args"]["step"] == step)
        # the stage ends before its task does (the task waits for it, wherever it ran), inside the step's subflow
        assert update["ts"] + update["dur"] <= task["ts"] + task["dur"]
        assert (
            subflows[step]["ts"] <= task["ts"]
            and task["ts"] + task["dur"] <= subflows[step]["ts"] + subflows[step]["dur"]
        )


def test_prefetched_rollouts_equal_rollouts_on_demand(workdir):
    """The next step's rollout started right after the weight sync samples exactly what the step would have sampled
    itself (validate_every=1 validates after every step, so nothing is prefetched there)."""
    prefetched, weights = _engines_only(["run.steps=2"], "prefetched")
    on_demand, weights_on_demand = _engines_only(["run.steps=2", "run.validate_every=1"], "on-demand")
    assert [m["rollout/prefetched_chunks"] for m in prefetched] == [2, 0]
    assert [m["rollout/prefetched_chunks"] for m in on_demand] == [0, 0]
    for key in ("critic/rewards/mean", "critic/rewards/max", "actor/pg_loss", "actor/grad_norm"):
        assert [m[key] for m in prefetched] == [m[key] for m in on_demand], key
    assert all(torch.equal(weights[k], weights_on_demand[k]) for k in weights)


class _SyncCachedFromAnEarlierProcess(DirectStages):
    """The stages of a resumed step whose weight sync comes back Cached from Prefect: the record the earlier process
    persisted (it prefetched the next step's chunks), with no sync and no prefetch in this process."""

    def call(self, name: str, step: int, chunk: int = 0, replica: int | None = None):
        if name == "sync_weights":
            return Synced(step, prefetched=num_chunks(self.engines.config), metrics={})
        return super().call(name, step, chunk, replica)


def test_a_weight_sync_cached_from_an_earlier_process_starts_no_run_ahead():
    """The run-ahead starts the next step only after a rollout this process prefetched. A resumed run's cached sync
    record says "prefetched" while the rollout engine may still hold other weights (a vLLM server that just started
    holds version 0): the next step must wait for the resume's own sync, not sample and train ahead of it."""
    cfg = load_experiment(None, TINY + ["run.name=cached-sync", "run.steps=3"])
    engines = build_engines(cfg, durable=False)
    try:
        run_step(engines, 0, _SyncCachedFromAnEarlierProcess(engines))
        before = trainable_state(engines.trainer, all_lora=True)
        engines.memory.ahead.wait()  # whatever the run-ahead started has run
        assert not engines.memory.has_chunk(1, 0)  # step 2 neither prefetched nor sampled ahead
        after = trainable_state(engines.trainer, all_lora=True)
        assert all(torch.equal(before[k], after[k]) for k in before)  # and not trained ahead either
        version = engines.policy_version
        sync_engines(engines, -1, prefetch_next=False)  # the resume's own sync (diffrl/flows/train.py)
        run_step(engines, 1, DirectStages(engines))
        assert engines.policy_version == version + 2  # the resume's sync, then step 2's
        engines.memory.drain()
    finally:
        cluster.drop("cached-sync")
