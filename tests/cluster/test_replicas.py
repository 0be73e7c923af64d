"""Engine replicas (`cluster.gpus: N`) on the local test cluster (2 CPUs, fake GPUs, gloo): two replicas give one
replica's per-step metrics and weights at the same global batch, each replica's stages are their own Prefect tasks,
and the settings that cannot be shared over replicas are refused when the config loads."""

from __future__ import annotations

import pytest
from conftest import TINY
from safetensors.torch import load_file

from benchmarks import scaling  # what it reads of a replicated run

ray = pytest.importorskip("ray")

RAY = ["cluster.mode=ray", "cluster.actor_timeout_s=120", "model.device=auto"]
# Keys that must agree: sampling and rewards (same seeds, same weights), advantages over the whole step, the update.
SAME = (
    "critic/rewards/mean",
    "critic/advantages/max",
    "reward/jpeg_compressibility",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/ratio_mean",
    "rollout_corr/logprob_abs_diff_mean",
)


def _checkpoints(run_dir) -> list:
    """The run's kept checkpoint folders, oldest first."""
    return sorted(run_dir.glob("checkpoints/step_*"), key=lambda p: int(p.name.split("_")[1]))


def _full_weights(checkpoint, tmp) -> dict:
    """The model weights of a full fine-tuning checkpoint (torch.distributed.checkpoint, read in one process)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint / "dcp", tmp)
    return torch.load(tmp)["model"]


def _task_states(flow_run: str, like: str, *, runs: int, timeout_s: float = 120.0) -> dict[str, list[str]]:
    """The final state names of the task runs named like `like` in the flow runs named `flow_run`, one entry per
    flow run, oldest flow run first; waits until `runs` such task runs are all in a final state.

    Prefect 3 records a task run's states from the events its process sends, after the flow has returned (a loaded
    machine lags): reading at once saw some still Running, or not there yet. Flow runs are ordered by their own
    creation (written by the API call that started them), not by the task rows' creation (written as events arrive).
    """
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            flows = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run])))
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run])),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=like)),
                limit=200,
            )
            settled = len(tasks) == runs and all(t.state is not None and t.state.is_final() for t in tasks)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    order = {f.id: i for i, f in enumerate(sorted(flows, key=lambda f: f.created))}
    states: dict[str, list[str]] = {}
    for task in sorted(tasks, key=lambda t: (order.get(t.flow_run_id, len(order)), t.created)):
        states.setdefault(task.name, []).append(task.state.name if task.state else "no state")
    return states


def _task_names(flow_run: str, like: str) -> list[str]:
    """The names of the task runs named like `like` in the flow runs named `flow_run` (other tests of the session
    run replicas too)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=like)),
            limit=200,
        )
    return sorted(r.name for r in runs)


@pytest.mark.slow
def test_two_replicas_train_as_one(ray_cluster, prefect_server, workdir):
    """2 replicas (one fake GPU each, FSDP2 over gloo) against 1, both through the train flow, 2 steps of 2 chunks:
    replica r generates chunk r; the metrics of each step and the final LoRA weights agree. Then each run resumes on
    the other number of GPUs."""
    from test_ray_mode import _gone, _metrics

    from diffrl.engines import cluster
    from diffrl.flows.train import train

    two_steps = TINY + RAY + ["run.steps=2", "run.checkpoint_every=1"]
    train(config=None, overrides=two_steps + ["run.name=one"])
    train(config=None, overrides=two_steps + ["cluster.gpus=2", "run.name=two"])

    one, two = _metrics(workdir, "one"), _metrics(workdir, "two")
    for key in SAME:
        assert len(two[key]) == 2 and two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    assert two["perf/gpus"] == [2.0, 2.0] and one["perf/gpus"] == [1.0, 1.0]
    # each replica's update took the other's chunk over the process group, not from the store
    assert two["exchange/bytes"][0] > 0 and "exchange/bytes" not in one
    for ours, theirs in zip(_checkpoints(workdir / "runs/one"), _checkpoints(workdir / "runs/two"), strict=True):
        a, b = load_file(ours / "trainable.safetensors"), load_file(theirs / "trainable.safetensors")
        assert ours.name == theirs.name and sorted(a) == sorted(b)  # the trained weights after each step
        for name in a:  # Adam's step is ~lr (3e-3) whatever the gradient's size: where a gradient is near 0, the
            # float noise of another summation order moves it by a few 1e-6 (seen: 2.2e-6); a lost or doubled
            # gradient share moves many entries by ~lr
            assert b[name] == pytest.approx(a[name], abs=1e-5), name

    actors = {a["name"]: a for a in cluster.list_actors("two")}
    assert sorted(actors) == ["two/engine", "two/engine-1"]
    replicas = [actors["two/engine"], actors["two/engine-1"]]
    assert [(a["rank"], a["world"]) for a in replicas] == [(0, 2), (1, 2)]
    assert replicas[0]["gpus"] != replicas[1]["gpus"] and all(len(a["gpus"]) == 1 for a in replicas)
    assert [a["policy_version"] for a in replicas] == [2, 2]

    # one Prefect task per replica and stage (step 1 of run "two")
    assert _task_names("two-step-1", "-step1-replica") == [
        "advantages-step1-replica0",
        "advantages-step1-replica1",
        "generate-step1-replica0-chunk0",
        "generate-step1-replica1-chunk1",
        "sync_weights-step1-replica0",
        "sync_weights-step1-replica1",
        "update_actor-step1-replica0",
        "update_actor-step1-replica1",
    ]
    # what benchmarks/scaling.py reads of each replica: its persisted stage records, both steps, both replicas
    records = scaling.replica_records(str(workdir / "runs/two"), "two")
    assert {stage: sorted(steps) for stage, steps in records.items()} == {
        "generate": [0, 1],
        "update_actor": [0, 1],
        "sync_weights": [0, 1],
    }
    assert [[r["chunk"] for r in records["generate"][s]] for s in (0, 1)] == [[0, 1], [0, 1]]
    replicas = scaling.per_replica(records, 2, range(1, 3))
    rank0 = [records["update_actor"][s][0]["metrics"]["timing_s/update_actor"] for s in (0, 1)]
    assert replicas["update_actor"][0] == pytest.approx(sum(rank0) / 2)  # the median of two steps
    assert all(t > 0 for t in replicas["generate"] + replicas["update_actor"])
    assert replicas["peak_memory_allocated_gb"] == [None, None]  # CPU devices: no CUDA peak
    # another number of GPUs for a run: refused in one line while its warm replicas hold the old count; once they are
    # stopped, each run resumes on the other count (2 -> 1 and 1 -> 2) and their third steps agree
    three = TINY + RAY + ["run.steps=3", "run.checkpoint_every=1"]
    with pytest.raises(ValueError, match=r"warm engine replicas built from another config \(cluster.gpus 2 -> 1\)"):
        train(config=None, overrides=three + ["run.name=two"])
    assert cluster.stop_actors("two") == ["two/engine", "two/engine-1", "two/gpus"]
    cluster.stop_actors("one")
    _gone("two")
    train(config=None, overrides=three + ["run.name=two"])
    train(config=None, overrides=three + ["cluster.gpus=2", "run.name=one"])
    one, two = _metrics(workdir, "one"), _metrics(workdir, "two")
    assert one["perf/gpus"] == [1.0, 1.0, 2.0] and two["perf/gpus"] == [2.0, 2.0, 1.0]
    for key in SAME:
        assert two[key][2] == pytest.approx(one[key][2], rel=1e-5, abs=1e-6), key
    cluster.stop_actors("one")
    cluster.stop_actors("two")


@pytest.mark.slow
def test_two_replicas_fine_tune_fully_as_one(ray_cluster, workdir):
    """Full fine-tuning: the replicas shard the denoiser with FSDP2 and each samples with its own unsharded copy,
    loaded after every update; the second step's samples (from the copies) and update equal one replica's."""
    from test_ray_mode import _metrics

    from diffrl.engines import cluster
    from diffrl.flows.train import train

    full = TINY + RAY + ["run.steps=2", "train.lora=false", "train.lr=1.0e-4", "data.num_val_prompts=0"]
    train(config=None, overrides=full + ["run.name=full1"])
    train(config=None, overrides=full + ["cluster.gpus=2", "run.name=full2"])
    one, two = _metrics(workdir, "full1"), _metrics(workdir, "full2")
    for key in SAME:  # the first step: same samples, same update
        assert two[key][0] == pytest.approx(one[key][0], rel=1e-5, abs=1e-6), key
    first = [_full_weights(_checkpoints(workdir / "runs" / r)[0], workdir / f"{r}.pt") for r in ("full1", "full2")]
    assert sorted(first[0]) == sorted(first[1])
    # FSDP2's sharded update: within float noise of one process's. Adam's first step is lr * g / (|g| + eps), about
    # lr (1e-4) times sign(g): a lost or doubled gradient share flips signs (2e-4 apart); where |g| is near eps the
    # noise of another summation order shows (seen: 2.2e-6)
    for name, weight in first[0].items():
        assert first[1][name] == pytest.approx(weight, abs=1e-5), name
    # the second step samples with each replica's copy: loaded with the updated weights (no log-prob gap), and
    # its rewards are one replica's but where a weight's last bit flips a JPEG's size by a byte
    assert two["rollout_corr/logprob_abs_diff_mean"][1] == 0.0 and two["actor/ratio_mean"][1] == 1.0
    assert two["critic/rewards/mean"][1] == pytest.approx(one["critic/rewards/mean"][1], rel=1e-3)
    assert two["sync/num_tensors"][0] > 0 and one["sync/num_tensors"] == [0.0, 0.0]  # gathered into each copy
    cluster.stop_actors("full1")
    cluster.stop_actors("full2")


@pytest.mark.slow
def test_a_failed_replica_generates_again_and_the_others_come_back_cached(ray_cluster, workdir, monkeypatch):
    """Replica 1's generate of step 2 fails (an injected fault in its actor): the run stops; rerun with fresh
    actors, step 2 resumes with replica 0's chunk Cached and only replica 1's generated again, each stored once."""
    from diffrl.engines import cluster
    from diffrl.engines.store.trajectories import TrajectoryStore
    from diffrl.flows.train import train

    overrides = TINY + RAY + ["run.steps=2", "cluster.gpus=2", "run.name=retry", "data.num_val_prompts=0"]
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "generate@2.1")  # step 2, chunk 1: replica 1's
    with pytest.raises(Exception, match="injected fault in stage 'generate'"):
        train(config=None, overrides=overrides)
    cluster.stop_actors("retry")  # the actors took the fault spec with them: fresh ones without it
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    train(config=None, overrides=overrides)
    states = _task_states("retry-step-2", "generate-step2-replica", runs=4)  # 2 replicas x 2 runs
    assert states["generate-step2-replica0-chunk0"] == ["Completed", "Cached"]
    assert states["generate-step2-replica1-chunk1"] == ["Failed", "Completed"]
    store = TrajectoryStore(workdir / "runs/retry/trajectories.lance")
    assert store.committed_chunks(1) == {0, 1} and store.num_rows(1) == 8  # each chunk of step 2 once
    cluster.stop_actors("retry")


def test_gpus_auto_counts_the_clusters_gpus(ray_cluster):
    from diffrl.configs.schema import load_experiment
    from diffrl.engines import cluster

    cfg = load_experiment(None, TINY + RAY + ["cluster.gpus=auto"])
    assert cfg.cluster.gpus == "auto" and cluster.gpus_seen(cfg) == 4  # the test cluster's 4 fake GPUs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.gpus=2"], "needs cluster.mode: ray"),
        (RAY + ["cluster.gpus=0"], "cluster.gpus must be a number of GPUs >= 1 or 'auto'"),
        (RAY + ["cluster.gpus=two"], "cluster.gpus must be a number of GPUs >= 1 or 'auto'"),
        (RAY + ["cluster.gpus=4"], r"8 samples come in 2 chunk\(s\) .* multiple of 4 \(e.g. rollout.chunk_size: 2\)"),
        (RAY + ["cluster.gpus=2", "rollout.chunk_size=8"], "chunk_size: 4"),
        (RAY + ["cluster.gpus=8", "rollout.chunk_size=1", "train.mini_batch_prompts=1"], r"group_size \(4\) must"),
        (RAY + ["cluster.actor_threads=0"], "cluster.actor_threads must be a number of threads >= 1 or 'auto'"),
        (RAY + ["cluster.actor_threads=many"], "cluster.actor_threads must be a number of threads >= 1 or 'auto'"),
    ],
)
def test_settings_replicas_cannot_share_are_refused(overrides, message):
    from diffrl.configs.schema import load_experiment

    with pytest.raises(ValueError, match=message):
        load_experiment(None, TINY + overrides)


def test_actor_threads_share_the_node_cpus_among_the_runs_actors():
    """Ray gives each worker one thread; "auto" gives each of the run's actors its share of the node's CPUs."""
    from diffrl.configs.schema import load_experiment
    from diffrl.engines.actors import actor_names, actor_threads

    one = load_experiment(None, TINY + RAY)  # one engine replica
    assert actor_threads(one, 16.0) == 16 and actor_threads(one, 3.0) == 3
    four = load_experiment(None, TINY + RAY + ["cluster.gpus=4", "rollout.chunk_size=2", "train.mini_batch_prompts=1"])
    assert len(actor_names(four)) == 4 and actor_threads(four, 128.0) == 32
    assert actor_threads(four, 2.0) == 1  # never 0
    assert actor_threads(load_experiment(None, TINY + RAY + ["cluster.actor_threads=5"]), 2.0) == 5


def test_an_algorithm_sampling_with_its_old_adapter_needs_one_replica():
    from diffrl.configs.schema import load_experiment

    with pytest.raises(ValueError, match="samples with the trainer's old \\(EMA\\) adapter"):
        load_experiment("quickstart", RAY + ["cluster.gpus=2", "rollout.chunk_size=24"])
    assert load_experiment("quickstart", RAY + ["cluster.gpus=1"]).cluster.replicas == 1


def test_replica_r_generates_the_r_th_share_of_the_chunks():
    from diffrl.configs.schema import load_experiment
    from diffrl.engines.step.plan import replica_chunks

    cfg = load_experiment(None, TINY + RAY + ["cluster.gpus=2", "rollout.chunk_size=2"])  # 4 chunks of 2 samples
    assert [list(replica_chunks(cfg, r)) for r in (0, 1)] == [[0, 1], [2, 3]]
    one = load_experiment(None, TINY + RAY + ["rollout.chunk_size=2"])
    assert list(replica_chunks(one, 0)) == [0, 1, 2, 3]
