"""Ctrl-C, SIGTERM and a Cancel in the Prefect UI stop `diffrl train` mid-step in one line, release its run lock, stop
its temporary Prefect server and leave a run the same command resumes (diffrl/flows/interrupts.py).

Ctrl-C is SIGINT to the command's whole process group, as a terminal sends it: were it to reach the temporary server
too, Prefect's client would retry the dead server for about 70 s before printing a traceback. The UI's Cancel is the
request the UI sends: the flow run's state set to Cancelling.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid

from e2e_settings import TINY
from mlflow.tracking import MlflowClient
from test_orphans import _alive, _server, _wait

from diffrl.flows.cli import main
from diffrl.flows.prefect_server import STOP_S

CAP_S = 180  # a failure cap only: how long a step may take to start, or the run to end, before the test gives up
AT = r"at step \d+( \(\w+\))?"  # where the run was: "at step 3 (generate)"


def _start(workdir, run_name: str) -> tuple[subprocess.Popen, str]:
    """`diffrl train` of 100 steps in its own process group (the test cleans the group up whatever happens); returns it
    once it has finished a step, committed its checkpoint (so a rerun resumes whatever the interrupt catches) and
    started the next, with the path of its stderr."""
    err = str(workdir / f"stderr-{time.monotonic_ns()}.txt")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own temporary server
    env["PREFECT_HOME"] = str(workdir / "prefect-home")  # a database of its own: the test reads the flow run's state
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffrl.flows.cli", "train", *TINY, "run.steps=100", "data.num_val_prompts=0"]
            + [f"run.name={run_name}"],
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=f,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + CAP_S
    pointer = workdir / "runs" / run_name / "checkpoints" / "latest.json"
    while not (re.search(r"^\[diffrl\] step \d+/100:", open(err).read(), re.M) and pointer.exists()):
        assert proc.poll() is None and time.monotonic() < deadline, open(err).read()[-3000:]
        time.sleep(0.1)
    return proc, err


def _lock_is_free(path: str) -> bool:
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        f.seek(0)
        return f.read() == ""  # released by the run itself (it empties the file), not only by the kernel


def test_ctrl_c_and_sigterm_stop_the_command_in_one_line_and_the_same_command_resumes(workdir):
    run_name = f"interrupts-{uuid.uuid4().hex[:8]}"
    lock = str(workdir / "runs" / run_name / "run.lock")
    for attempt, (how, said) in enumerate([("SIGINT", "interrupted"), ("SIGTERM", r"interrupted \(SIGTERM\)")]):
        proc, err = _start(workdir, run_name)
        try:
            server, _ = _server(proc.pid)  # the temporary Prefect server this diffrl started
            if how == "SIGINT":
                os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground process group
            else:
                os.kill(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=CAP_S)
            lines = open(err).read().strip().splitlines()
            assert code == 130, lines[-20:]
            assert all(line.startswith("[diffrl] ") for line in lines[:-1]), lines  # no traceback, no library noise
            assert re.fullmatch(rf"diffrl: {said} {AT}; rerun the same command to resume", lines[-1]), lines[-1]
            # stopped by diffrl, or at worst by its own watch of its parent within STOP_S of diffrl's exit
            stopped = _wait(lambda: not _alive(server), STOP_S + 5)
            assert stopped, f"the Prefect server (pid {server}) outlived diffrl"
            assert _lock_is_free(lock)
            assert (attempt == 1) == ("resuming after step" in "\n".join(lines))  # the rerun took the lock, resumed
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    assert mlflow_run.info.status == "KILLED"
    with sqlite3.connect(workdir / "prefect-home" / "prefect.db") as db:
        states = db.execute("SELECT state_name FROM flow_run WHERE name = ? ORDER BY created", (run_name,)).fetchall()
    assert [s for (s,) in states] == ["Crashed", "Crashed"]  # Prefect's record of each attempt


def test_a_cancel_in_the_prefect_ui_stops_the_run_in_one_line(workdir, capfd):
    """The command in this process (its temporary Prefect server is this process's): once step 1 is committed, a
    thread sends what the UI's Cancel button sends, the train flow run's state set to Cancelling."""
    run_name = f"cancel-{uuid.uuid4().hex[:8]}"
    found: dict = {}
    ended = threading.Event()  # the command returned: nothing left to cancel

    def cancel() -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter
        from prefect.states import Cancelling

        # no deadline of its own: on a busy machine the first step can take minutes; the command's end stops it
        pointer = workdir / "runs" / run_name / "checkpoints" / "latest.json"
        while not pointer.exists() and not ended.is_set():
            time.sleep(0.1)
        with get_client(sync_client=True) as client:
            running = FlowRunFilter(name={"any_": [run_name]}, state={"type": {"any_": ["RUNNING"]}})
            while not ended.is_set():
                flow_runs = client.read_flow_runs(flow_run_filter=running)
                if flow_runs:
                    found["id"] = flow_runs[0].id
                    client.set_flow_run_state(flow_runs[0].id, Cancelling())
                    return
                time.sleep(0.2)

    canceller = threading.Thread(target=cancel, daemon=True)
    canceller.start()
    try:
        code = main(["train", *TINY, "run.steps=100", "data.num_val_prompts=0", f"run.name={run_name}"])
    finally:
        ended.set()
    canceller.join(timeout=CAP_S)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("diffrl")]
    assert (
        code == 130
        and lines
        and re.fullmatch(rf"diffrl: cancelled in the Prefect UI {AT}; rerun the same command to resume", lines[-1])
    ), lines
    assert _lock_is_free(str(workdir / "runs" / run_name / "run.lock"))
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(found["id"]).state.name == "Cancelled"  # as the UI asked, not Crashed
