"""Ray mode on a local Ray cluster (2 CPUs, fake GPUs) with a loopback Prefect server: the same metrics as local
mode, warm actors across flow runs, a dead actor failing the step within the timeout, `diffrl cluster status/stop`,
and the retired placements refused with what replaces them."""

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
    train(config=None, overrides=two_steps + RAY + ["run.name=remote", "cluster.actor_threads=1"])
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
    assert sorted(actors) == ["remote/engine"]
    engine = actors["remote/engine"]
    assert len(engine["gpus"]) == 1  # placement: 1 (fake) GPU
    assert engine["holds"] == ["adapter", "rollout", "trainer", "reward", "store"] and engine["policy_version"] == 2
    assert engine["threads"] == 1  # cluster.actor_threads

    # a later flow run of the same run name finds the warm actors: the model is not built again
    train(config=None, overrides=TINY + RAY + ["run.name=remote", "run.steps=3", "run.compact_every=2"])
    again = {a["name"]: a for a in cluster.list_actors("remote")}
    assert again["remote/engine"]["actor_id"] == engine["actor_id"]
    assert again["remote/engine"]["pid"] == engine["pid"] and again["remote/engine"]["builds"] == 1
    # the step-2 checkpoint holds version 1 (saved before its sync); + the resume sync + step 3 sync
    assert again["remote/engine"]["policy_version"] == 3
    # actor_threads "auto" at the warm actor's next run: the 2 CPUs of the test cluster for its one actor
    assert again["remote/engine"]["threads"] == 2
    assert len(_metrics(workdir, "remote")["perf/time_per_step"]) == 3
    cluster.stop_actors("remote")


@pytest.mark.slow
def test_killed_actor_fails_the_step_within_the_timeout(ray_cluster, workdir):
    from diffrl.engines import cluster
    from diffrl.flows.train import train

    overrides = TINY + RAY + ["run.name=victim", "run.steps=2", "cluster.actor_timeout_s=120"]
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
    assert cluster.stop_actors("stall") == ["stall/engine"]
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
    assert "cli/engine" in status.stdout and "reward" in status.stdout and "trainer" in status.stdout
    assert "threads 2 " in status.stdout  # auto: the test cluster's 2 CPUs for the run's one actor
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


@pytest.mark.parametrize(
    "override, replacement",
    [
        ("cluster.placement=split", "every GPU is an engine replica"),
        ("cluster.trainers=2", "sharded over the engine replicas: set cluster.gpus: N"),
        ("cluster.reward_actors=2", "each engine replica scores its own chunks"),
        ("cluster.reward_gpus=1", "vLLM judge server"),
    ],
)
def test_retired_placements_are_refused_with_their_replacement(override, replacement):
    from diffrl.configs.schema import load_experiment

    with pytest.raises(ValueError, match=f"config key '{override.split('=')[0]}' is retired: .*{replacement}"):
        load_experiment(None, TINY + ["cluster.mode=ray", override])


@pytest.mark.slow
def test_sigterm_stops_the_runs_actors_and_releases_its_lock(ray_cluster, workdir):
    """SIGTERM (as `kill` or a batch scheduler sends it) to a `diffrl train` in Ray mode, once a step is committed:
    within 15 s the command ends in one line, its run lock is free and none of the run's actors is left in the cluster
    (their GPUs freed). A process of its own: ray.init installs its own SIGTERM handler, which must not replace
    diffrl's (this test's process joined Ray long before)."""
    import re
    import signal
    import uuid

    from test_interrupts import AT, _lock_is_free

    from diffrl.engines import cluster

    run_name = f"ray-sigterm-{uuid.uuid4().hex[:6]}"
    err = workdir / "stderr.txt"
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}  # the test's cluster; PREFECT_API_URL: its loopback server
    command = [sys.executable, "-m", "diffrl.flows.cli", "train", *TINY, *RAY, "run.steps=100"]
    with open(err, "w") as f:
        proc = subprocess.Popen(
            command + ["data.num_val_prompts=0", f"run.name={run_name}"],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=f,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        pointer = workdir / "runs" / run_name / "checkpoints" / "latest.json"
        while not (re.search(r"^\[diffrl\] step \d+/100:", err.read_text(), re.M) and pointer.exists()):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.1)
        assert cluster.list_actors(run_name)  # the run's engine actor is up
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
        lines = err.read_text().strip().splitlines()
        assert code == 130 and took < 15, (code, took, "\n".join(lines[-20:]))
        said = rf"diffrl: interrupted \(SIGTERM\) {AT}; rerun the same command to resume"
        assert re.fullmatch(said, lines[-1]), lines
        assert _lock_is_free(str(workdir / "runs" / run_name / "run.lock"))
        _gone(run_name)  # no actor of the run left alive (ray.kill is asynchronous: given up to 20 s more)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_ctrl_c_stops_the_runs_actors_and_releases_its_lock(ray_cluster, workdir, capfd):
    """Ctrl-C (SIGINT) to `diffrl train` in Ray mode, once a step is committed: within 15 s the run ends in one line,
    its run lock is free and none of its actors is left. The command runs in this process (`main`, what the `diffrl`
    script calls: no second start of its imports); that a signalled command then exits at once is the SIGTERM test's
    above and tests/e2e/test_interrupts.py's. Only a thread here signals, and only while `main` runs: outside it a
    SIGINT would stop pytest."""
    import re
    import signal
    import uuid

    from test_interrupts import AT, _lock_is_free

    from diffrl.engines import cluster
    from diffrl.flows.cli import main

    run_name = f"ray-sigint-{uuid.uuid4().hex[:6]}"
    pointer = workdir / "runs" / run_name / "checkpoints" / "latest.json"
    ended, sending, sent = threading.Event(), threading.Lock(), {}

    def interrupt() -> None:  # once step 1 is committed and the run's engine actor is up
        while not ended.is_set():
            if pointer.exists() and cluster.list_actors(run_name):
                with sending:  # `ended` is set under the same lock: no signal once `main` has returned
                    if not ended.is_set():
                        sent["at"] = time.monotonic()
                        os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.1)

    # before `main` installs diffrl's handler and after it puts this one back, a SIGINT must not stop pytest
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        code = main(["train", *TINY, *RAY, "run.steps=100", "data.num_val_prompts=0", f"run.name={run_name}"])
        took = time.monotonic() - sent.get("at", float("nan"))
    finally:
        with sending:
            ended.set()
        thread.join(timeout=30)
        signal.signal(signal.SIGINT, previous)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("diffrl")]
    assert "at" in sent and code == 130 and took < 15, (code, took, lines[-20:])
    assert re.fullmatch(rf"diffrl: interrupted {AT}; rerun the same command to resume", lines[-1]), lines
    assert _lock_is_free(str(workdir / "runs" / run_name / "run.lock"))
    _gone(run_name)
