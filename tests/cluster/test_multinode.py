"""Engine replicas on a Ray cluster of two nodes, emulated on this machine: a head and a second node started with
`ray start` (one CPU and one fake GPU each, token authentication, as docs/operations.md shows), joined by `diffrl
train` run as a user runs it. Two replicas land one on each node and train as one process does, with the run folder
on an S3-compatible object store both nodes reach (moto's server on loopback stands in for S3); a replica whose
process dies mid-step stops the run with one line naming it, its node and the stage, and the same command resumes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import TINY
from object_store import BUCKET, moto_server, run_overrides, s3, storage_options
from safetensors.torch import load, load_file
from servers import VENV_BIN, free_port

from diffrl.engines.ray_exposure import answers

ray = pytest.importorskip("ray")

REPLICAS = ["cluster.mode=ray", "cluster.gpus=2", "model.device=auto", "cluster.actor_timeout_s=120"]
RUN = ["run.steps=2", "run.checkpoint_every=1", "data.num_val_prompts=0"]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, diffrl_cache):
    """The environment of a driver joined to a two-node cluster (head and node on 127.0.0.1, each 1 CPU, 1 GPU)."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    token = tmp_path_factory.mktemp("token") / "auth_token"
    token.write_text("0123456789abcdef0123456789abcdef")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_ADDRESS=f"127.0.0.1:{port}")
    ray_bin = os.path.join(VENV_BIN, "ray")
    common = ["--block", "--num-cpus", "1", "--num-gpus", "1", "--disable-usage-stats"]
    common += ["--node-ip-address", "127.0.0.1"]
    head = [ray_bin, "start", "--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", temp]
    nodes = []
    try:
        for args in (head + common, [ray_bin, "start", "--address", f"127.0.0.1:{port}", *common]):
            nodes.append(
                subprocess.Popen(
                    args,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: stopped as a whole below, no other Ray touched
                )
            )
            deadline = time.time() + 90
            while not answers("127.0.0.1", port) and time.time() < deadline:
                time.sleep(0.5)
        ids = _node_ids(env)
        deadline = time.time() + 90
        while len(ids) < 2 and time.time() < deadline:  # the second node registers with the head
            time.sleep(1)
            ids = _node_ids(env)
        assert len(ids) == 2, f"the emulated cluster has nodes {ids}"
        yield env, ids
    finally:
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGKILL)  # SIGTERM: Ray's orderly shutdown took 33 s here
            node.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def _node_ids(env: dict) -> list[str]:
    """The alive nodes of the cluster at env's RAY_ADDRESS that have a GPU (their Ray node ids)."""
    code = (
        "import ray; ray.init(log_to_driver=False); "
        "print(' '.join(n['NodeID'] for n in ray.nodes() if n['Alive'] and n['Resources'].get('GPU')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def _diffrl(env: dict, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(VENV_BIN, "diffrl"), *args],
        env={**env, **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_two_replicas_on_two_nodes_train_as_one_process(two_nodes, workdir):
    """One replica on each node (their process group over the loopback network, gloo), the run folder in a bucket:
    the metrics of each step and the LoRA weights after it equal the in-process run's, and each step's rows, written
    by both replicas at once, are in the bucket's tables once each (the store ignores conditional PUTs: the commits
    go through the run's commit lock)."""
    import lance
    from test_ray_mode import _metrics
    from test_replicas import SAME, _checkpoints

    from diffrl.flows.train import train

    env, ids = two_nodes
    train(config=None, overrides=TINY + RUN + ["run.name=inprocess"])
    with moto_server() as endpoint:
        trained = _diffrl(env, "train", *TINY, *RUN, *REPLICAS, *run_overrides(endpoint, "nodes"))
        assert trained.returncode == 0, trained.stderr[-3000:]
        bucket = s3(endpoint)
        folder = f"{BUCKET}/runs/nodes"
        theirs = [load(bucket.cat(f"{folder}/checkpoints/step_{k}/trainable.safetensors")) for k in (1, 2)]
        for table in ("trajectories", "rewards", "advantages"):
            uri = f"s3://{folder}/{table}.lance"
            rows = lance.dataset(uri, storage_options=storage_options(endpoint)).to_table().to_pylist()
            keys = [(r["step"], r["group_id"], r["sample_index"]) for r in rows]
            assert len(keys) == len(set(keys)) == 16, (table, sorted(keys))  # 2 steps x 8 rows, each once
        assert not (workdir / "runs/nodes/checkpoints").exists()  # nothing of the run folder on the local disk
    status = _diffrl(env, "cluster", "status", "nodes")
    placed = dict(re.findall(r"^nodes/(engine(?:-1)?)\s+node (\w+)", status.stdout, re.M))
    assert sorted(placed) == ["engine", "engine-1"], status.stdout
    assert {placed["engine"], placed["engine-1"]} == {i[:8] for i in ids}  # one replica on each node
    lock = re.search(r"^nodes/commits\s+node \w+ pid \d+\s+commit lock: (\d+) commits", status.stdout, re.M)
    assert lock and int(lock.group(1)) >= 3 * 2 * 2, status.stdout  # each replica's rows of 3 tables, 2 steps

    one, two = _metrics(workdir, "inprocess"), _metrics(workdir, "nodes")
    for key in SAME:
        assert len(two[key]) == 2 and two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert two["perf/gpus"] == [2.0, 2.0] and two["exchange/bytes"][0] > 0
    for ours, b in zip(_checkpoints(workdir / "runs/inprocess"), theirs, strict=True):
        a = load_file(ours / "trainable.safetensors")
        for name in a:  # the tolerance of tests/cluster/test_replicas.py (Adam's step is ~lr whatever the gradient)
            assert b[name] == pytest.approx(a[name], abs=1e-5), name
    assert _diffrl(env, "cluster", "stop", "nodes").returncode == 0


@pytest.mark.slow
def test_a_replica_lost_mid_step_stops_the_run_in_one_line_and_the_command_resumes(two_nodes, workdir):
    """Replica 1's process dies in its update of step 2 (`update_actor@2.1:exit`, as a lost node or a kill -9 would):
    the run stops with one line naming the replica, its node and the stage, the run's other replica is stopped, no
    committed row is lost, and the same command resumes from the step-1 checkpoint to the end."""
    from diffrl.engines.store.trajectories import TrajectoryStore

    env, ids = two_nodes
    command = ["train", *TINY, *REPLICAS, "run.steps=3", "run.checkpoint_every=1", "data.num_val_prompts=0"]
    command.append("run.name=lost")
    failed = _diffrl(env, *command, extra_env={"DIFFRL_INJECT_FAULT": "update_actor@2.1:exit"})
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    line = failed.stderr.rstrip().splitlines()[-1]
    found = re.fullmatch(
        r"diffrl train: error: run 'lost': engine replica lost/engine-1 on node \S+ \(Ray node (\w{8})\) "
        r"died while the run waited for its (\w+) of step 2; its other replicas are stopped .* rerun the same command: "
        r"it resumes from the last checkpoint, every committed row kept \(traceback: runs/lost/diffrl\.log\)",
        line,
    )
    assert found, line
    # the stage the flow waited for: the replica ran its update ahead of the flow's tasks (diffrl/engines/step/ahead.py)
    assert found.group(1) in {i[:8] for i in ids}
    assert found.group(2) in ("generate", "score", "advantages", "update_actor")
    assert "no diffrl actors" in _diffrl(env, "cluster", "status", "lost").stdout  # both replicas stopped
    store = TrajectoryStore(workdir / "runs/lost/trajectories.lance")
    assert store.committed_chunks(0) == {0, 1} and store.num_rows(0) == 8  # step 1, committed before the loss

    resumed = _diffrl(env, *command)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 1" in resumed.stderr
    store = TrajectoryStore(workdir / "runs/lost/trajectories.lance")
    assert [(store.committed_chunks(k), store.num_rows(k)) for k in range(3)] == [({0, 1}, 8)] * 3  # each once
    assert (workdir / "runs/lost/checkpoints/step_3").is_dir()
    assert _diffrl(env, "cluster", "stop", "lost").returncode == 0
