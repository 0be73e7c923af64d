"""Asynchronous (one-step-off) training on two engine replicas (`cluster.gpus: 2`) on the local test cluster (2 CPUs,
fake GPUs, gloo), through `diffrl train`: each replica samples its chunk of the next step with its own behaviour copy
while the replicas' FSDP2 group updates, and the trained LoRA tensors reach every copy in memory at each weight sync.
The run gives the one-process asynchronous run's metrics at the same global batch."""

from __future__ import annotations

import json

import lance
import pytest
from conftest import TINY
from test_ray_mode import _metrics

from diffrl.flows.cli import main

ray = pytest.importorskip("ray")

# Sampling and rewards (same seeds, same behaviour weights), the correction's ratios, the update.
SAME = (
    "critic/rewards/mean",
    "critic/advantages/max",
    "actor/pg_loss",
    "actor/grad_norm",
    "rollout_corr/ratio_mean",
    "rollout_corr/ratio_max",
)
RAY = ["cluster.mode=ray", "cluster.actor_timeout_s=120", "model.device=auto", "cluster.gpus=2"]
ONE_STEP_OFF = ["run.async.max_staleness=1", "train.rollout_correction=tis", "data.num_val_prompts=0"]


@pytest.mark.slow
def test_one_step_off_on_two_replicas(ray_cluster, workdir):
    from diffrl.engines import cluster

    assert main(["train", *TINY, *ONE_STEP_OFF, "run.name=async1"]) == 0
    assert main(["train", *TINY, *RAY, *ONE_STEP_OFF, "run.name=async2"]) == 0
    metrics, one = _metrics(workdir, "async2"), _metrics(workdir, "async1")
    for key in SAME:
        assert len(metrics[key]) == 3 and metrics[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    # step 1 samples at version 0 and trains at 0; step 2's chunks were sampled beside step 1's update by each
    # replica's behaviour copy, still at version 0, and train at 1; step 3's at 1 and train at 2: the whole step's
    # staleness, the same on both replicas
    assert metrics["async/staleness_max"] == [0.0, 1.0, 1.0]
    assert metrics["async/staleness_mean"] == [0.0, 1.0, 1.0]
    assert metrics["async/dropped"] == [0.0, 0.0, 0.0]
    assert metrics["perf/gpus"] == [2.0, 2.0, 2.0]
    assert metrics["rollout_corr/ratio_mean"][0] == pytest.approx(1.0, abs=1e-5)  # the behaviour policy's own step
    # each weight sync copied the trained LoRA tensors into both behaviour copies (a LoRA replica without run.async
    # samples with the trainer's module: nothing to copy)
    assert all(n > 0 for n in metrics["sync/num_tensors"]) and all(b > 0 for b in metrics["sync/bytes"])
    rows = lance.dataset(f"{workdir}/runs/async2/trajectories.lance").to_table().to_pylist()
    assert len(rows) == 3 * 8 and len({(r["step"], r["group_id"], r["sample_index"]) for r in rows}) == 3 * 8
    versions = {(r["step"], r["group_id"]): set() for r in rows}
    for r in rows:
        versions[(r["step"], r["group_id"])].add(r["policy_version"])
    assert all(len(v) == 1 for v in versions.values())  # each prompt group sampled at one policy version
    assert {(step, v) for (step, _), vs in versions.items() for v in vs} == {(1, 0), (2, 0), (3, 1)}
    for step in (2, 3):  # the kept checkpoints: each step trained every one of its 8 rows, once
        saved = json.loads((workdir / f"runs/async2/checkpoints/step_{step}/update_metrics.json").read_text())
        assert saved["update/rows"] == 8.0
    replicas = sorted(cluster.list_actors("async2"), key=lambda a: a["rank"])
    assert [a["policy_version"] for a in replicas] == [3, 3]
    cluster.stop_actors("async2")
