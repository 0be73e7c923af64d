"""prefect.yaml end to end on a loopback Prefect server: `prefect deploy`, a process worker running the
train deployment, an injected update_actor failure, `prefect flow-run retry` of that flow run
rerunning only update_actor and what follows (generate/score/advantages come back Cached, their Lance
rows reused), then the evaluate deployment on the run's latest checkpoint. These are the commands
docs/operations.md shows."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import lance
import pytest
from e2e_settings import TINY

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cluster"))
from servers import VENV_BIN, start_prefect_server  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _prefect(env: dict, *args: str, timeout: float = 300) -> str:
    out = subprocess.run(
        [os.path.join(VENV_BIN, "prefect"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


async def _task_states(url: str, flow_run_id: str) -> dict:
    """{rl_step subflow name: {task name: state name of its latest run}} of one train flow run."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    async with PrefectClient(url) as client:
        parent_tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        subflows = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id={"any_": [t.id for t in parent_tasks]})
        )
        out = {}
        for sub in subflows:
            tasks = await client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[sub.id]))
            )
            # task runs are named after their stage, step and chunk: generate-step3-chunk1, update_actor-step3
            assert all(re.fullmatch(r"[a-z_]+-step\d+(-chunk\d+)?", t.name) for t in tasks), [t.name for t in tasks]
            out.setdefault(sub.name, []).append(
                {t.name.split("-step")[0]: t.state.name for t in tasks} | {"_state": sub.state.name}
            )
        return out


def _check_worker_console(console: str, url: str, flow_run_id: str) -> None:
    """The worker's console is as quiet as `diffrl train`'s (diffrl/flows/console.py): no loading or saving bars,
    transformers notices or MLflow INFO lines, and the failure's traceback once, though Prefect logs it for the
    task, the step flow, the train flow and the engine. The run's log in Prefect's UI keeps every traceback."""
    for noise in ("Loading weights", "Writing model shards", "[transformers]", " INFO mlflow", "Loading pipeline"):
        assert noise not in console, f"{noise!r} in the worker's console:\n{console[-3000:]}"
    assert console.count("Traceback (most recent call last)") == 1, console[-6000:]
    assert console.count("Encountered exception during execution") == 2  # the step flow and the train flow
    logged = asyncio.run(_flow_run_logs(url, flow_run_id))
    assert any("Encountered exception" in m and "Traceback (most recent call last)" in m for m in logged), logged


async def _flow_run_logs(url: str, flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with PrefectClient(url) as client:
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [log.message for log in logs]


@pytest.mark.slow
def test_train_deployment_fails_in_update_actor_and_a_retry_reruns_only_what_follows(tmp_path, diffrl_cache):
    home = tmp_path / "prefect_home"
    home.mkdir()
    server, url = start_prefect_server(str(home))
    env = {
        **os.environ,
        "PREFECT_API_URL": url,
        "PREFECT_HOME": str(home),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
        "DIFFRL_CACHE": diffrl_cache,
    }
    env.pop("DIFFRL_INJECT_FAULT", None)
    try:
        _prefect(env, "work-pool", "create", "diffrl", "--type", "process")
        _prefect(env, "--no-prompt", "deploy", "--all")
        params = {"config": "quickstart", "overrides": TINY + [f"run.root={tmp_path}/runs", "run.name=nightly"]}
        run = _prefect(env, "deployment", "run", "train/train", "--params", json.dumps(params))
        flow_run_id = next(w for w in run.split() if len(w) == 36 and w.count("-") == 4)
        # the first attempt dies in update_actor of step 2, as an out-of-memory would
        failed = subprocess.run(
            [os.path.join(VENV_BIN, "prefect"), "worker", "start", "--pool", "diffrl", "--run-once"],
            cwd=REPO,
            env={**env, "DIFFRL_INJECT_FAULT": "update_actor@2"},
            timeout=300,
            capture_output=True,
            text=True,
        )
        # the advice is the Prefect retry of this flow run, not the local "rerun the same command"
        console = failed.stdout + failed.stderr
        assert "retry this flow run to resume (run 'nightly'" in console, console[-3000:]
        assert f"prefect flow-run retry {flow_run_id}" in console and "rerun the same command" not in console
        _check_worker_console(console, url, flow_run_id)
        table = f"{tmp_path}/runs/nightly/trajectories.lance"
        before = lance.dataset(table).to_table(filter="step = 2", columns=["write_id"]).column("write_id").to_pylist()
        assert len(before) == 8 and lance.dataset(table).count_rows("step = 3") == 0

        _prefect(env, "flow-run", "retry", flow_run_id)  # the UI's "Retry" button does the same
        _prefect(env, "worker", "start", "--pool", "diffrl", "--run-once")
        states = asyncio.run(_task_states(url, flow_run_id))
        attempts = {a["_state"]: a for a in states["nightly-step-2"]}
        assert sorted(attempts) == ["Completed", "Failed"], states["nightly-step-2"]
        first, retried = attempts["Failed"], attempts["Completed"]
        assert first["update_actor"] == "Failed"
        assert {retried[k] for k in ("generate", "score", "advantages")} == {"Cached"}
        assert retried["update_actor"] == "Completed" and retried["sync_weights"] == "Completed"
        after = lance.dataset(table).to_table(filter="step = 2", columns=["write_id"]).column("write_id").to_pylist()
        assert after == before  # step 2's rows were reused, not rewritten
        assert lance.dataset(table).count_rows("step = 3") == 8
        # step 1's subflow run was left alone: Prefect matches a retried run's subflow calls by call count, and
        # without flows.train.pin_step_key it handed step 1's finished run back for the retry's first call
        # (step 2), which then never trained
        assert [a["_state"] for a in states["nightly-step-1"]] == ["Completed"], states
        assert sorted(states) == ["nightly-step-1", "nightly-step-2", "nightly-step-3"], states
        assert os.path.isdir(f"{tmp_path}/runs/nightly/checkpoints/step_3")

        # the evaluate deployment scores the run's latest checkpoint (step 3: 3 RL steps done) into MLflow
        _prefect(env, "deployment", "run", "evaluate/evaluate", "--params", json.dumps(params))
        _prefect(env, "worker", "start", "--pool", "diffrl", "--run-once")
        from mlflow.tracking import MlflowClient

        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        [trained] = client.search_runs(
            [e.experiment_id for e in client.search_experiments()], filter_string="tags.`diffrl.run_name` = 'nightly'"
        )
        assert trained.data.tags["mlflow.source.type"] == "JOB"  # a deployment's flow run, as MLflow names jobs
        assert trained.data.tags["mlflow.source.name"] == "train/train"
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            filter_string="tags.`diffrl.run_name` = 'nightly-eval'",
        )
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
        assert runs[0].data.tags["diffrl.checkpoint"].endswith("runs/nightly/checkpoints/step_3")
        history = client.get_metric_history(runs[0].info.run_id, "val/reward")
        assert [m.step for m in history] == [3] and -1.0 < history[0].value < 0.0  # jpeg_compressibility is negative
    finally:
        server.terminate()
        server.wait(timeout=30)
