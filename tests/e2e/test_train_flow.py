"""The training flow end to end on the tiny model: Lance rows, MLflow metrics, checkpoints, resume
after a failure in every stage, a failing reward server, and bad input rejected before any work."""

from __future__ import annotations

import os
import re
import socket

import lance
import mlflow
import pytest
import torch
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.configs.loader import ConfigError
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.flows.train import train

ROWS_PER_STEP = 8  # 2 prompts x group 4


def _history(workdir, key: str) -> list[int]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    assert len(runs) == 1, "a resumed run must continue the same MLflow run"
    return sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, key))


def _check_table(run_dir: str, steps: int) -> None:
    store = TrajectoryStore(os.path.join(run_dir, "trajectories.lance"))
    assert store.steps() == list(range(steps))  # the store's API counts from 0, as the code does
    raw = lance.dataset(os.path.join(run_dir, "trajectories.lance")).to_table(
        columns=["step", "group_id", "sample_index", "write_id", "chunk"]
    )
    for step in range(steps):
        traj = store.read_step(step, with_latents=False, with_images=False)
        keys = list(zip(traj.group_ids, traj.sample_index.tolist()))
        assert len(keys) == ROWS_PER_STEP and len(set(keys)) == ROWS_PER_STEP
        # nothing written twice: the physical table holds exactly one copy of each committed chunk; its step column
        # holds the step number a person sees (1, 2, 3)
        assert sum(1 for s in raw.column("step").to_pylist() if s == step + 1) == ROWS_PER_STEP
        rewards, _, valid = store.read_rewards(step)
        advantages = store.read_advantages(step)
        assert valid.all() and torch.isfinite(rewards).all()
        for group in set(traj.group_ids):  # group-normalised: zero mean within each group
            rows = [i for i, g in enumerate(traj.group_ids) if g == group]
            assert abs(float(advantages[rows].mean())) < 1e-4


def test_three_steps_write_rows_metrics_and_checkpoints(workdir):
    result = train(config=None, overrides=TINY)
    run_dir = "runs/quickstart"
    _check_table(run_dir, 3)
    for key in (
        "critic/rewards/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "perf/throughput",
        "timing_s/generate",
        "timing_s/update_actor",
        "reward/jpeg_compressibility",
    ):
        assert _history(workdir, key) == [1, 2, 3], key
    assert _history(workdir, "val/reward") == [0, 3]
    kept = sorted(d for d in os.listdir(f"{run_dir}/checkpoints") if d.startswith("step_"))
    assert kept == ["step_2", "step_3"]  # every checkpoint_every-th step (2) plus the latest two (2, 3)
    assert result["last_step"] == 3
    # Prefect names: the train flow run after the run (not a random name); no "None/..." UI link in local mode
    from prefect.client.orchestration import get_client

    mlflow_client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    tags = mlflow_client.search_runs([mlflow_client.get_experiment_by_name("diffrl-quickstart").experiment_id])[0]
    tags = tags.data.tags
    if os.environ.get("PREFECT_API_URL"):  # a real server (an earlier test in the session may have left one set)
        assert (
            tags["prefect.flow_run_url"].startswith("http")
            and tags["prefect.flow_run_id"] in tags["prefect.flow_run_url"]
        )
    else:  # the temporary server has no UI: no link, rather than "None/runs/..."
        assert tags["prefect.flow_run_url"] == ""
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(tags["prefect.flow_run_id"]).name == "quickstart"
        assert _step_run_names(client, tags["prefect.flow_run_id"]) == {
            "quickstart-step-1": ["advantages-step1", "generate-step1-chunk0", "generate-step1-chunk1"]
            + ["score-step1-chunk0", "score-step1-chunk1", "sync_weights-step1", "update_actor-step1"],
            "quickstart-step-2": ["advantages-step2", "generate-step2-chunk0", "generate-step2-chunk1"]
            + ["score-step2-chunk0", "score-step2-chunk1", "sync_weights-step2", "update_actor-step2"],
            "quickstart-step-3": ["advantages-step3", "generate-step3-chunk0", "generate-step3-chunk1"]
            + ["score-step3-chunk0", "score-step3-chunk1", "sync_weights-step3", "update_actor-step3"],
        }  # the step numbers of the console and MLflow
    _check_mlflow_record(mlflow_client, workdir)


def _step_run_names(client, train_run_id: str) -> dict[str, list[str]]:
    """{step subflow run name: its task run names, sorted} of one train flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter, TaskRunFilterFlowRunId

    parents = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [train_run_id]}))
    steps = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_task_run_id={"any_": [t.id for t in parents]}))
    return {
        step.name: sorted(
            t.name
            for t in client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[step.id]))
            )
        )
        for step in steps
    }


def _check_mlflow_record(client: MlflowClient, workdir) -> None:
    """What MLflow's own pages show of the run: its source, the prompt sets as dataset inputs,
    the final LoRA as a logged model that registers into the model registry, with its base model recorded."""
    import json

    from safetensors import safe_open

    experiment = client.get_experiment_by_name("diffrl-quickstart")
    run = client.search_runs([experiment.experiment_id])[0]
    tags = run.data.tags
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"] == "diffrl train quickstart"
    assert "mlflow.source.git.commit" not in tags  # the working directory is no git checkout
    inputs = {d.tags[0].value: d.dataset for d in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["train", "validation"]
    assert inputs["train"].name == "generator:ocr" and json.loads(inputs["train"].profile)["num_rows"] == 16
    assert json.loads(inputs["validation"].profile)["num_rows"] == 2  # data.num_val_prompts
    [output] = run.outputs.model_outputs
    assert output.step == 3  # the MLflow step of the last RL step
    model = client.get_logged_model(output.model_id)
    assert (model.name, model.model_type, model.source_run_id) == ("lora", "diffusers-lora", run.info.run_id)
    base = model.params["base_model"]
    assert os.path.isfile(os.path.join(base, "model_index.json"))  # a folder DiffusionPipeline.from_pretrained takes
    folder = mlflow.artifacts.download_artifacts(f"models:/{model.model_id}", dst_path=str(workdir / "lora"))
    with safe_open(os.path.join(folder, "pytorch_lora_weights.safetensors"), "pt") as f:
        assert base in f.metadata()["lora_adapter_metadata"]  # base_model_name_or_path, as diffrl export writes it
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    version = mlflow.register_model(f"models:/{model.model_id}", "quickstart-lora")
    assert str(version.version) == "1" and version.source == f"models:/{model.model_id}"


@pytest.mark.parametrize("fault", ["generate@2.1", "score@2.0", "advantages@2", "update_actor@2", "sync_weights@2"])
def test_resume_after_a_failure_in_each_stage(workdir, monkeypatch, fault):
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", fault)
    with pytest.raises(Exception, match="injected fault"):
        train(config=None, overrides=TINY)
    table = "runs/quickstart/trajectories.lance"
    before = lance.dataset(table).to_table(filter="step = 2 AND chunk = 0", columns=["write_id"])
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    train(config=None, overrides=TINY)
    _check_table("runs/quickstart", 3)
    if fault.startswith("generate"):  # chunk 0 of the interrupted step was reused, not rewritten
        after = lance.dataset(table).to_table(filter="step = 2 AND chunk = 0", columns=["write_id"])
        assert before.num_rows == 4 and after.column("write_id").to_pylist() == before.column("write_id").to_pylist()
    assert _history(workdir, "perf/time_per_step") == [1, 2, 3]  # no gap, no duplicate
    assert _history(workdir, "actor/grad_norm") == [1, 2, 3]


def _fragments(run_dir: str) -> dict[str, int]:
    tables = ("trajectories", "rewards", "advantages", "embeddings")
    return {t: len(lance.dataset(f"{run_dir}/{t}.lance").get_fragments()) for t in tables}


def test_the_flow_compacts_its_tables_every_compact_every_steps(workdir):
    """Each append adds a Lance fragment and each read opens them all: without compaction an 80-step run's steps
    slowed from 0.45 to 1.0 s (docs/performance.md). With run.compact_every 2, 4 steps leave one fragment per
    table instead of one per append; every row, reward and advantage reads back as in an uncompacted run of the
    same seeds; and a resumed run goes on from the compacted tables. (Every step's latents are kept here, to
    compare them: run.keep_latents_steps=-1.)"""
    keep = "run.keep_latents_steps=-1"
    train(config=None, overrides=TINY + ["run.steps=4", "run.compact_every=0", "run.name=plain", keep])
    train(config=None, overrides=TINY + ["run.steps=4", "run.compact_every=2", "run.name=compacted", keep])
    plain_fragments = _fragments("runs/plain")
    assert plain_fragments.pop("embeddings") > 1  # one per step that met new prompts
    assert plain_fragments == {"trajectories": 8, "rewards": 8, "advantages": 4}  # 2 chunks a step
    assert _fragments("runs/compacted") == {"trajectories": 1, "rewards": 1, "advantages": 1, "embeddings": 1}
    plain = TrajectoryStore("runs/plain/trajectories.lance")
    compacted = TrajectoryStore("runs/compacted/trajectories.lance")
    for step in range(4):
        a, b = plain.read_step(step), compacted.read_step(step)
        assert (a.group_ids, a.prompts) == (b.group_ids, b.prompts)
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
        assert torch.equal(plain.read_rewards(step)[0], compacted.read_rewards(step)[0])
        assert torch.equal(plain.read_advantages(step), compacted.read_advantages(step))
    train(config=None, overrides=TINY + ["run.steps=6", "run.compact_every=2", "run.name=compacted", keep])
    assert compacted.steps() == list(range(6)) and _fragments("runs/compacted")["trajectories"] == 1
    assert all(compacted.num_rows(step) == ROWS_PER_STEP for step in range(6))


def test_default_retention_drops_old_latents_and_keeps_the_rows(workdir):
    """run.keep_latents_steps defaults to 2: after 4 steps compacted every 2, step 0's latents are gone (a read
    that needs them says so) while its rows stay, and the last steps' latents read back for a resume."""
    train(config=None, overrides=TINY + ["run.steps=4", "run.compact_every=2"])
    store = TrajectoryStore("runs/quickstart/trajectories.lance")
    with pytest.raises(ValueError, match="dropped by retention"):
        store.read_step(0)
    assert store.read_step(0, with_latents=False).prompts  # prompts, images, rewards stay
    assert store.read_step(3).latents.shape[-1] > 0
    # Prefect's persisted stage results: only the last two steps' stay (a UI retry reruns the step in flight)
    steps = {int(re.search(r"-step(\d+)-", p.name).group(1)) for p in (workdir / "runs/quickstart/prefect").iterdir()}
    assert steps == {2, 3}


def test_compact_every_must_not_be_negative(workdir):
    with pytest.raises(ConfigError, match=r"run.compact_every must be >= 0 \(0 = never\), got -1"):
        train(config=None, overrides=TINY + ["run.compact_every=-1"])


def test_failing_reward_server_fails_the_step_with_a_clear_message(workdir):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = TINY + [
        "reward.components=[{name: http_scorer, options: {url: 'http://127.0.0.1:%d/score', retries: 1, "
        "backoff_s: 0.01, timeout_s: 2}}]" % port
    ]
    with pytest.raises(Exception, match="http_scorer"):
        train(config=None, overrides=overrides)
    assert not os.path.exists("runs/quickstart/checkpoints/latest.json")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lrr=1"], r"unknown config key 'train.lrr'.*did you mean 'train.lr'"),
        (["data.train=/nonexistent/prompts.parquet"], r"/nonexistent/prompts.parquet"),
        (["model.path=/nonexistent/model"], r"/nonexistent/model"),
        (["model.path=tiny:nope"], r"unknown tiny architecture"),
    ],
)
def test_bad_input_fails_before_any_work(workdir, overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        train(config=None, overrides=TINY + overrides)
    assert not os.path.exists("runs/quickstart/trajectories.lance")


@pytest.mark.slow
def test_quickstart_config_runs_on_the_shipped_reference_model(workdir, capsys):
    """The embedded default as `make quickstart` runs it, cut to 2 steps: the shipped shapes model,
    geneval_lite, held-out validation with val/reward and val/accuracy in MLflow."""
    result = train(config=None, overrides=["run.steps=2", "data.num_val_prompts=8"])
    assert result["last_step"] == 2
    assert _history(workdir, "val/reward") == [0, 2]
    assert _history(workdir, "val/accuracy") == [0, 2]
    assert _history(workdir, "reward/geneval_lite") == [1, 2]
    err = capsys.readouterr().err  # the progress lines: an ETA while steps are left, a before -> after summary
    assert "step 1/2: reward" in err and ", eta 0m" in err.split("step 1/2")[1].splitlines()[0]
    assert "validation, before -> after training: val/reward " in err and " -> " in err.split("before -> after")[1]


def test_eta_is_the_median_of_the_last_ten_steps_times_the_steps_left():
    from diffrl.flows.train import _eta

    assert _eta([1.0, 100.0, 2.0], 30) == ", eta 1m00s"  # median 2.0 s x 30
    assert _eta([5.0] * 20 + [1.0] * 10, 10) == ", eta 0m10s"  # only the last 10 count
    assert _eta([4000.0], 2) == ", eta 2h13m" and _eta([1.0], 0) == "" and _eta([], 5) == ""
