"""What `diffrl train` prints by default: its own progress lines only; -v brings the libraries'
output back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import lance
import pytest
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.flows.cli import quiet_libraries


def test_default_console_has_only_diffrl_lines(workdir):
    """The whole run through the real CLI in a fresh process: no Prefect, MLflow, diffusers/transformers bars or
    peft warnings, on stdout or stderr. Its step numbers are the same on every surface: _check_step_numbers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_LOGGING", "MLFLOW_LOGGING", "DIFFRL_V"))}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "diffrl", "train", *TINY, "run.steps=2", "algorithm=diffusion_nft"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines and all(line.startswith("[diffrl] ") for line in lines), "\n".join(lines)
    _check_step_numbers(workdir, lines)


def _check_step_numbers(workdir, console: list[str]) -> None:
    """Step k is the k-th RL step everywhere: the console's `step k/2`, MLflow's step axis (validation before
    training at 0), checkpoints/step_k with latest.json and trainer_state.json saying k, the Lance tables' step
    column, and the MLflow step of the logged LoRA (diffrl/engines/numbering.py)."""
    run = workdir / "runs" / "quickstart"
    assert [line.split(":")[0] for line in console if " step " in line and "/2:" in line] == [
        "[diffrl] step 1/2",
        "[diffrl] step 2/2",
    ]
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    history = {
        key: [m.step for m in client.get_metric_history(mlflow_run.info.run_id, key)]
        for key in ("critic/rewards/mean", "val/reward")
    }
    assert history == {"critic/rewards/mean": [1, 2], "val/reward": [0, 2]}
    images = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "images")]
    stepped = [re.match(r"images/(\w+)\+step\+(\d+)\+", name) for name in images]  # <key>+step+<k>+timestamp...
    found = {(m.group(1), int(m.group(2))) for m in stepped if m}
    assert found == {("rollout", 1), ("rollout", 2), ("validation", 0), ("validation", 2)}, images
    assert [m.step for m in mlflow_run.outputs.model_outputs] == [2]
    assert json.loads((run / "run.json").read_text())["format"] == 2  # diffrl/flows/run_format.py
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1", "step_2"]
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 2
    assert json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())["step"] == 2
    for table in ("trajectories", "rewards", "advantages"):
        steps = lance.dataset(str(run / f"{table}.lance")).to_table(columns=["step"]).column("step").to_pylist()
        assert sorted(set(steps)) == [1, 2], table


def test_verbose_names_prefect_s_runs_and_shows_a_failure_s_traceback_once(workdir):
    """`diffrl -v train` printed bare `Finished in state Completed()` lines (193 in the quickstart): diffrl's log
    format dropped the task and flow run names Prefect's own format gives. And Prefect logs a failure for the task,
    the step flow and the train flow: its traceback now comes with the first of them only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_LOGGING", "MLFLOW_LOGGING", "DIFFRL_V"))}
    env["DIFFRL_INJECT_FAULT"] = "update_actor@1"  # fails after generate, score and advantages of step 1 finished
    proc = subprocess.run(
        [sys.executable, "-m", "diffrl", "-v", "train", *TINY, "run.steps=1"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    states = [line for line in lines if "Finished in state" in line]
    assert states and all(re.match(r"(Task|Flow) run '[\w-]+' - Finished in state ", s) for s in states), states
    assert "Task run 'generate-step1-chunk0' - Finished in state Completed()" in lines
    failed = [i for i, line in enumerate(lines) if re.search(r" - (Task run failed with|Encountered) exception", line)]
    assert [lines[i + 1].startswith("Traceback") for i in failed] == [True, False, False], lines[-80:]


@pytest.fixture
def own_environment():
    """quiet_libraries sets variables of its own (DIFFRL_VERBOSE, HF_HUB_DISABLE_PROGRESS_BARS...): the environment is
    put back whole after the test, or a later test of this process (and the processes it starts) would inherit -v."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_verbose_restores_the_libraries_levels(monkeypatch, own_environment):
    for key in ("PREFECT_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "DIFFRL_VERBOSE"):
        monkeypatch.delenv(key, raising=False)
    quiet_libraries(verbose=True)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "INFO" and os.environ["MLFLOW_LOGGING_LEVEL"] == "INFO"
    assert os.environ["DIFFRL_VERBOSE"] == "1"
    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "DEBUG")  # a level the user exported wins
    quiet_libraries(verbose=False)
    assert os.environ["PREFECT_LOGGING_LEVEL"] == "DEBUG"
