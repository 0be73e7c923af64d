"""Ray mode on a local Ray cluster (2 CPUs, 2 fake GPUs) with a loopback Prefect server: the same
metrics as local mode, warm actors across flow runs, a dead actor failing the step within the
timeout, `diffrl cluster status/stop`, and the refusal without a Prefect server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import lance
import pytest
from conftest import TINY
from mlflow.tracking import MlflowClient

ray = pytest.importorskip("ray")

RAY = ["cluster.mode=ray", "cluster.actor_timeout_s=60", "model.device=auto"]


def _metrics(workdir, run_name: str) -> dict[str, list[float]]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string=f"tags.`diffrl.run_name` = '{run_name}'"
    )
    run = runs[0]
    return {
        k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]
        for k in run.data.metrics
    }


def _gone(run_name: str) -> None:
    from diffrl.engines import cluster

    deadline = time.time() + 20  # ray.kill is asynchronous: the names go once the actors are dead
    while cluster.list_actors(run_name) and time.time() < deadline:
        time.sleep(0.2)
    assert cluster.list_actors(run_name) == []


@pytest.mark.slow
def test_ray_mode_matches_local_and_keeps_actors_warm(ray_cluster, workdir):
    from diffrl.engines import cluster
    from diffrl.flows.train import train

    # compact_every 2: the second step's compaction merges the prompt-embedding cache inside the rollout's actor
    two_steps = TINY + ["run.steps=2", "model.device=auto", "run.compact_every=2"]
    train(config=None, overrides=two_steps + ["run.name=local"])
    train(config=None, overrides=two_steps + RAY + ["run.name=remote", "cluster.actor_threads=2"])
    for run_name in ("local", "remote"):
        embeddings = lance.dataset(os.path.join(workdir, f"runs/{run_name}/embeddings.lance"))
        assert len(embeddings.get_fragments()) == 1, run_name
    local, remote = _metrics(workdir, "local"), _metrics(workdir, "remote")
    for key in (
        "critic/rewards/mean",
        "critic/advantages/max",
        "actor/pg_loss",
        "actor/grad_norm",
        "val/reward",
        "reward/jpeg_compressibility",
    ):
        assert remote[key] == pytest.approx(local[key], rel=1e-5, abs=1e-6), key

    actors = {a["name"]: a for a in cluster.list_actors("remote")}
    assert sorted(actors) == ["remote/engine", "remote/reward"]
    engine = actors["remote/engine"]
    assert len(engine["gpus"]) == 1 and actors["remote/reward"]["gpus"] == []  # placement: 1 (fake) GPU
    assert engine["holds"] == ["adapter", "rollout", "trainer", "store"] and engine["policy_version"] == 2
    assert engine["threads"] == actors["remote/reward"]["threads"] == 2  # not the one thread Ray gives a worker

    # a later flow run of the same run name finds the warm actors: the model is not built again
    train(config=None, overrides=TINY + RAY + ["run.name=remote", "run.steps=3", "run.compact_every=2"])
    again = {a["name"]: a for a in cluster.list_actors("remote")}
    assert again["remote/engine"]["actor_id"] == engine["actor_id"]
    assert again["remote/engine"]["pid"] == engine["pid"] and again["remote/engine"]["builds"] == 1
    # the step-2 checkpoint holds version 1 (saved before its sync); + the resume sync + step 3 sync
    assert again["remote/engine"]["policy_version"] == 3
    # actor_threads "auto" at the warm actors' next run: the 2 CPUs of the test cluster over its 2 actors
    assert again["remote/engine"]["threads"] == again["remote/reward"]["threads"] == 1
    assert len(_metrics(workdir, "remote")["perf/time_per_step"]) == 3
    cluster.stop_actors("remote")


@pytest.mark.slow
def test_killed_actor_fails_the_step_within_the_timeout(ray_cluster, workdir):
    from diffrl.engines import cluster
    from diffrl.flows.train import train

    overrides = TINY + RAY + ["run.name=victim", "run.steps=2", "cluster.actor_timeout_s=30"]
    table = os.path.join(workdir, "runs/victim/trajectories.lance")
    killed = {}

    def kill_mid_step():  # once step 1's first chunk is committed, the engine actor dies
        deadline = time.time() + 240
        while time.time() < deadline:
            if os.path.exists(table) and lance.dataset(table).count_rows("step = 1") > 0:
                ray.kill(ray.get_actor("victim/engine", namespace="diffrl"), no_restart=True)
                killed["at"] = time.time()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=kill_mid_step, daemon=True)
    thread.start()
    try:
        with pytest.raises(Exception, match="victim.*(died|not alive)"):
            train(config=None, overrides=overrides)
        failed_at = time.time()
        thread.join(timeout=5)
        assert "at" in killed and failed_at - killed["at"] < 30
    finally:
        cluster.stop_actors("victim")


def test_stalled_actor_call_times_out_with_a_clear_error(ray_cluster, workdir):
    import tests_cluster_helpers as helpers

    from diffrl.configs.schema import load_experiment
    from diffrl.engines import cluster
    from diffrl.flows.build import build_engines

    ray.cloudpickle.register_pickle_by_value(helpers)
    cfg = load_experiment(None, TINY + RAY + ["run.name=stall", "model.device=cpu"])
    handle = build_engines(cfg)  # building may take longer than a stage's timeout: it waits 60 s
    handle.config.cluster.actor_timeout_s = 2.0
    started = time.time()
    with pytest.raises(TimeoutError, match="cluster.actor_timeout_s=2"):
        handle.run("rollout", helpers.stall, 30.0)
    assert time.time() - started < 10
    assert cluster.stop_actors("stall") == ["stall/engine", "stall/reward"]
    _gone("stall")


def test_cluster_status_and_stop_commands(ray_cluster, workdir):
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.build import build_engines

    build_engines(load_experiment(None, TINY + RAY + ["run.name=cli", "model.device=cpu"]))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    status = subprocess.run(
        [sys.executable, "-m", "diffrl.flows.cli", "cluster", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    assert "cli/engine" in status.stdout and "cli/reward" in status.stdout and "trainer" in status.stdout
    assert "threads 1 " in status.stdout  # auto: the test cluster's 2 CPUs over the run's 2 actors
    stop = subprocess.run(
        [sys.executable, "-m", "diffrl.flows.cli", "cluster", "stop", "cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0, stop.stderr
    assert "cli/engine" in stop.stdout
    _gone("cli")


def test_ray_mode_without_a_prefect_server_is_refused(workdir, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from diffrl.configs.schema import load_experiment
    from diffrl.flows.build import build_engines

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings({PREFECT_API_URL: None}):
        with pytest.raises(ValueError, match="prefect server start"):
            build_engines(load_experiment(None, TINY + RAY + ["run.name=noserver"]))


@pytest.mark.slow
def test_split_placement_matches_local_and_syncs_weights_by_version(ray_cluster, workdir):
    """placement: split puts the rollout and the trainer in their own actors, one (fake) GPU each; the
    trainer's weights reach the rollout by version after each update, so the metrics equal local mode's."""
    from diffrl.engines import cluster
    from diffrl.flows.train import train

    two_steps = TINY + ["run.steps=2", "model.device=auto"]
    train(config=None, overrides=two_steps + ["run.name=local"])
    train(config=None, overrides=two_steps + RAY + ["cluster.placement=split", "run.name=split"])
    local, split = _metrics(workdir, "local"), _metrics(workdir, "split")
    for key in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "val/reward"):
        assert split[key] == pytest.approx(local[key], rel=1e-5, abs=1e-6), key
    actors = {a["name"]: a for a in cluster.list_actors("split")}
    assert sorted(actors) == ["split/reward", "split/rollout", "split/trainer"]
    assert len(actors["split/rollout"]["gpus"]) == 1 and len(actors["split/trainer"]["gpus"]) == 1
    assert actors["split/rollout"]["gpus"] != actors["split/trainer"]["gpus"]
    assert actors["split/rollout"]["policy_version"] == actors["split/trainer"]["policy_version"] == 2
    cluster.stop_actors("split")


@pytest.mark.slow
def test_data_parallel_trainer_actors_match_local(ray_cluster, workdir):
    """cluster.trainers: 2 -- two trainer actors join one torch.distributed group (gloo on this CPU
    machine, NCCL on GPUs) and train with FSDP2, each rank on half of every mini-batch: the metrics
    equal local mode's (one process), rank 0 commits the checkpoints, and the rollout actor samples
    with the trained weights by version."""
    from diffrl.engines import cluster
    from diffrl.flows.train import train

    two_steps = TINY + ["run.steps=2", "model.device=auto"]
    train(config=None, overrides=two_steps + ["run.name=local"])
    train(config=None, overrides=two_steps + RAY + ["cluster.placement=split", "cluster.trainers=2", "run.name=dp"])
    local, dp = _metrics(workdir, "local"), _metrics(workdir, "dp")
    for key in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "actor/ratio_mean"):
        assert dp[key] == pytest.approx(local[key], rel=1e-5, abs=1e-6), key
    actors = {a["name"]: a for a in cluster.list_actors("dp")}
    assert sorted(actors) == ["dp/reward", "dp/rollout", "dp/trainer", "dp/trainer-1"]
    ranks = [actors["dp/trainer"], actors["dp/trainer-1"]]
    assert [(a["rank"], a["world"]) for a in ranks] == [(0, 2), (1, 2)]
    assert len({a["gpus"][0] for a in [*ranks, actors["dp/rollout"]]}) == 3  # one (fake) GPU each
    assert actors["dp/rollout"]["policy_version"] == ranks[0]["policy_version"] == ranks[1]["policy_version"] == 2
    assert (workdir / "runs" / "dp" / "checkpoints" / "step_2" / "update_metrics.json").exists()
    assert cluster.stop_actors("dp") == ["dp/reward", "dp/rollout", "dp/trainer", "dp/trainer-1", "dp/gpus"]
    _gone("dp")


def test_data_parallel_trainers_need_split_ray_mode():
    from diffrl.configs.schema import load_experiment

    with pytest.raises(ValueError, match="needs cluster.mode: ray and cluster.placement: split"):
        load_experiment(None, TINY + ["cluster.mode=ray", "cluster.trainers=2"])
    with pytest.raises(ValueError, match="cluster.trainers must be >= 1"):
        load_experiment(None, TINY + ["cluster.trainers=0"])
