"""A real crash: `diffrl train` killed mid-step (os._exit, as SIGKILL), then the same command again (in this
process: `main`, what the `diffrl` script calls)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import lance
import mlflow
import pytest
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.flows.cli import main


def _diffrl(args: list[str], cwd, **env) -> subprocess.CompletedProcess:
    """Run `diffrl train` in its own process group; output goes to files, not pipes: a process killed
    with os._exit leaves its temporary Prefect server running for a few seconds (until it sees its parent gone),
    which would hold pipes open. The group is removed afterwards."""
    out_path, err_path = os.path.join(cwd, "stdout.txt"), os.path.join(cwd, "stderr.txt")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffrl.flows.cli", "train", *args],
            cwd=cwd,
            stdout=out,
            stderr=err,
            env={**os.environ, **env},
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    with open(out_path) as out, open(err_path) as err:
        return subprocess.CompletedProcess(proc.args, code, out.read(), err.read())


def _rerun(args: list[str], capfd) -> subprocess.CompletedProcess:
    """The same `diffrl train` command again, in this process (`main` is what the `diffrl` script calls): the
    resumed run needs no kill, so it skips a fresh interpreter's imports and Prefect server start (~15 s a run on
    the 2-core CI machine). The crash itself stays a real process killed mid-step (`_diffrl`)."""
    capfd.readouterr()
    code = main(["train", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["diffrl", "train", *args], code, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["update_actor@2:exit", "checkpoint@2.2:stall"])  # the update; its checkpoint
def test_killed_run_resumes_with_every_step_once(workdir, capfd, fault):
    killed = _diffrl(TINY, workdir, DIFFRL_INJECT_FAULT=fault)
    assert killed.returncode == 137, killed.stderr[-2000:]
    # step 1's checkpoint is written behind the next step (the writer may lag 2 steps): on a loaded machine the kill
    # in step 2 can come before it lands, and the rerun then trains step 1 again on its stored rows
    pointer = workdir / "runs/quickstart/checkpoints/latest.json"
    committed = json.loads(pointer.read_text())["step"] if pointer.exists() else None
    assert committed in (None, 1)  # never step 2's: the kill came inside it
    done = _rerun(TINY, capfd)
    assert done.returncode == 0, done.stderr[-2000:]
    if committed == 1:
        assert "resuming after step 1" in done.stderr
    else:
        assert "resuming" not in done.stderr, done.stderr[-2000:]
    rows = lance.dataset(f"{workdir}/runs/quickstart/trajectories.lance").to_table(columns=["step"])
    counts = {s: rows.column("step").to_pylist().count(s) for s in range(1, 4)}
    assert counts == {1: 8, 2: 8, 3: 8}  # step 2's chunks were reused, not written again
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "critic/rewards/mean"))
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_a_crash_before_queued_rows_land_resumes_with_every_step_once(workdir, capfd):
    """The step core writes rows behind the stages that made them: the process dies in the background writer
    while it writes step 2's second chunk, after that chunk's generate stage may have completed (and persisted
    its Prefect result). The rerun drops such results whose rows never landed and makes the chunk again."""
    killed = _diffrl(TINY, workdir, DIFFRL_INJECT_FAULT="write_rows@2.1:exit")
    assert killed.returncode == 137, killed.stderr[-2000:]
    done = _rerun(TINY, capfd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming after step 1" in done.stderr
    rows = lance.dataset(f"{workdir}/runs/quickstart/trajectories.lance").to_table(columns=["step", "chunk"])
    pairs = list(zip(rows.column("step").to_pylist(), rows.column("chunk").to_pylist()))
    chunks = [(s, c) for s in range(1, 4) for c in range(2)]
    assert {k: pairs.count(k) for k in chunks} == {k: 4 for k in chunks}  # every chunk once, none twice
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])[0]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "critic/rewards/mean")) == [1, 2, 3]


@pytest.mark.slow
def test_a_crash_right_after_a_checkpoint_keeps_the_policy_versions(workdir, capfd):
    """The process hangs in step 2's weight sync (sync_weights@2:stall) while the writer commits step 2's
    checkpoint, then dies: step 2 is done but its metrics never reached MLflow and its weight sync never ran. The
    rerun logs step 2's metrics with one weight sync, not two: step 3's rows carry policy version 2, as in an
    uninterrupted run (they carried 3)."""
    killed = _diffrl(TINY, workdir, DIFFRL_INJECT_FAULT="sync_weights@2:stall")
    assert killed.returncode == 137, killed.stderr[-2000:]
    with open(f"{workdir}/runs/quickstart/checkpoints/latest.json") as f:
        assert json.load(f)["step"] == 2  # committed while the step hung
    done = _rerun(TINY, capfd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming after step 2" in done.stderr
    rows = lance.dataset(f"{workdir}/runs/quickstart/trajectories.lance").to_table(columns=["step", "policy_version"])
    pairs = set(zip(rows.column("step").to_pylist(), rows.column("policy_version").to_pylist()))
    assert pairs == {(1, 0), (2, 1), (3, 2)}  # (step number, the policy version that sampled it)
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])[0]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "critic/rewards/mean")) == [1, 2, 3]


def test_bad_config_key_exits_2_with_one_line(workdir):
    bad = _diffrl(["train.lrr=1"], workdir)
    assert bad.returncode == 2
    assert "did you mean 'train.lr'" in bad.stderr and "Traceback" not in bad.stderr


def _cli(command: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffrl.flows.cli", command, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_evaluate_without_a_checkpoint_is_a_clear_error(workdir):
    bad = _cli("evaluate", ["run.name=never-trained"], workdir)
    assert bad.returncode == 2 and "has no checkpoint" in bad.stderr and "Traceback" not in bad.stderr
