"""What a long `diffrl train` leaves in Prefect's database: the last KEEP_STEP_RUNS steps' subflow runs with their task
runs and states (older ones are deleted after each step), and no event feed on the temporary server
(diffrl/flows/rl_step.py, diffrl/flows/prefect_server.py)."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid

from e2e_settings import TINY

from diffrl.flows.cli import main


def _database() -> str:
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url.get_secret_value()
    return url.split("///", 1)[1]


def _count(sql: str, ids: list[str]) -> int:
    """`sql` with `{0}` standing for the ids' placeholders; Prefect stores UUIDs as text, with or without dashes
    depending on the column type."""
    marks = ",".join("?" * len(ids))
    with sqlite3.connect(_database()) as db:
        return db.execute(sql.format(marks), ids + [i.replace("-", "") for i in ids]).fetchone()[0]


def _wait_for_task_runs(flow_run_ids: list[str], expected: int, cap_s: float = 120.0) -> None:
    """Until the flow runs' `expected` task runs and their 3 states each (pending, running, completed) are recorded."""
    tasks = "SELECT count(*) FROM task_run WHERE flow_run_id IN ({0}) OR flow_run_id IN ({0})"
    where = "flow_run_id IN ({0}) OR flow_run_id IN ({0})"
    states = f"SELECT count(*) FROM task_run_state WHERE task_run_id IN (SELECT id FROM task_run WHERE {where})"
    deadline = time.monotonic() + cap_s  # a failure cap only
    while (found := (_count(tasks, flow_run_ids), _count(states, flow_run_ids)))[0] < expected or found[
        1
    ] < 3 * expected:
        assert time.monotonic() < deadline, f"{found} of {expected} task runs and their states recorded"
        time.sleep(0.2)


def test_old_step_runs_leave_the_database_the_latest_stay_and_no_secret_is_kept(workdir):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    from diffrl.flows.rl_step import KEEP_STEP_RUNS, forget_old_step_runs
    from diffrl.flows.run_config import held_overrides

    run_name = f"records-{uuid.uuid4().hex[:8]}"
    secret = "run.storage_options={token: sekrit-4417, aws_region: us-east-1}"  # what a run on S3 is given
    assert main(["train", *TINY, "run.steps=3", "data.num_val_prompts=0", f"run.name={run_name}", secret]) == 0
    steps = FlowRunFilter(name={"like_": f"{run_name}-step-"})
    with get_client(sync_client=True) as client:
        runs = {run.name: run for run in client.read_flow_runs(flow_run_filter=steps)}
        assert sorted(runs) == [f"{run_name}-step-{k}" for k in (1, 2, 3)]  # 3 steps: all kept
        # the server records task runs from the client's events, after them: wait until all 3 steps' 7 stages each
        # are in (else a late event would record a task run of a deleted step after the deletion)
        _wait_for_task_runs([str(run.id) for run in runs.values()], 3 * 7)
        # as after step index 2 + KEEP_STEP_RUNS - 1: the step runs of indices 0 and 1 go
        assert forget_old_step_runs(run_name, 1 + KEEP_STEP_RUNS) == 2
        left = client.read_flow_runs(flow_run_filter=steps)
        assert [run.name for run in left] == [f"{run_name}-step-3"]
    gone = [str(runs[f"{run_name}-step-{k}"].id) for k in (1, 2)]
    parents = [str(runs[f"{run_name}-step-{k}"].parent_task_run_id) for k in (1, 2)]
    kept = str(runs[f"{run_name}-step-3"].id)
    with sqlite3.connect(_database()) as db:
        count = _count
        tasks = "SELECT count(*) FROM task_run WHERE flow_run_id IN ({0}) OR flow_run_id IN ({0})"
        assert count(tasks, gone) == 0 and count(tasks, [kept]) == 7  # the latest step's stages stay
        assert count("SELECT count(*) FROM task_run WHERE id IN ({0}) OR id IN ({0})", parents) == 0
        states = "SELECT count(*) FROM task_run_state WHERE task_run_id IN (SELECT id FROM task_run WHERE {})"
        assert count(states.format("flow_run_id IN ({0}) OR flow_run_id IN ({0})"), [kept]) >= 7 * 3
        orphans = "SELECT count(*) FROM task_run_state WHERE task_run_id NOT IN (SELECT id FROM task_run)"
        assert db.execute(orphans).fetchone()[0] == 0  # the deleted task runs' states went with them
        # the train flow run's parameters hold no secret; the flow had the real value (a run on S3 would need it)
        [(parameters,)] = db.execute("SELECT parameters FROM flow_run WHERE name = ?", (run_name,)).fetchall()
        assert "sekrit" not in parameters and "{aws_region: us-east-1, token: '***'}" in parameters
        assert held_overrides(json.loads(parameters)["overrides"])[-1] == secret  # what the flow loaded its config from
        # no event feed: Prefect's client sends each state change as an event; the temporary server keeps none
        assert db.execute("SELECT count(*) FROM events WHERE related LIKE ?", (f"%{run_name}%",)).fetchone()[0] == 0
