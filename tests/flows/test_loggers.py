"""The run's loggers (diffrl/flows/loggers.py): MLflow, TensorBoard and W&B get the same metrics at the same steps, each
read back from its own files; the run folder's record carries resume whatever the loggers; a missing package is one
line naming the extra to install. W&B runs offline (no network here), as `run.loggers: [wandb]` does by default."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from logged_files import (
    assert_same_scalars,
    mlflow_scalars,
    tensorboard_images,
    tensorboard_scalars,
    wandb_config,
    wandb_scalars,
)

from diffrl.configs.loader import ConfigError
from diffrl.configs.schema import check_logger_packages, load_experiment
from diffrl.flows.loggers import Place, RunLoggers
from diffrl.flows.tracking import Tracker

pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install 'diffrl[tensorboard]'")
pytest.importorskip("wandb", reason="the wandb extra: pip install 'diffrl[wandb]'")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return tmp_path / "runs" / "r"


def _open(names: list[str], folder, record: bool = True) -> RunLoggers:
    place = Place("loggers", "r", str(folder / "run.json"), str(folder))
    return RunLoggers(names, place, record_path=str(folder / "logged.json") if record else None)


def _log_a_short_run(loggers: RunLoggers, steps: range) -> None:
    """What the train flow logs: the validation before training at 0, then each step's metrics and images."""
    images = np.full((4, 16, 16, 3), 200, dtype=np.uint8)
    if steps.start == 1:
        loggers.log_values({"val/reward": 0.25, "val/accuracy": 0.5}, 0)
    for step in steps:
        loggers.log_images(images, ["a", "b", "c", "d"], "rollout", step)
        metrics = {"critic/rewards/mean": 0.1 * step, "actor/grad_norm": math.inf, "perf/time_per_step": 1.0 + step}
        loggers.log_metrics({**metrics, "actor/pg_loss": math.nan if step == 2 else -0.01 * step}, step)


def test_every_logger_gets_the_same_metrics_at_the_same_steps(run_folder, tmp_path):
    loggers = _open(["mlflow", "tensorboard", "wandb"], run_folder)
    loggers.log_config({"run": {"name": "r", "storage_options": {"secret": "S3CRET"}}})
    loggers.set_tags({"diffrl.run_name": "r"})
    _log_a_short_run(loggers, range(1, 4))
    loggers.finish()
    mlflow = mlflow_scalars(f"sqlite:///{tmp_path}/mlflow.db", loggers.run_ids["mlflow"])
    assert mlflow["critic/rewards/mean"] == [(1, 0.1), (2, 0.2), (3, 0.30000000000000004)]
    assert_same_scalars(mlflow, tensorboard_scalars(str(run_folder / "tensorboard")), "tensorboard")
    assert_same_scalars(mlflow, wandb_scalars(str(run_folder)), "wandb")
    assert tensorboard_images(str(run_folder / "tensorboard"))["rollout"] == [(s, 1024, 256 + 30) for s in (1, 2, 3)]
    assert json.loads((run_folder / "logged.json").read_text()) == {
        "step": 3,
        "before_training": {"val/reward": 0.25, "val/accuracy": 0.5},
    }
    state = json.loads((run_folder / "run.json").read_text())
    assert state["mlflow_run_id"] == loggers.run_ids["mlflow"] and state["wandb_run_id"] == loggers.run_ids["wandb"]
    config = wandb_config(str(run_folder))
    assert config["run"] == {"name": "r", "storage_options": {"secret": "***"}}  # secrets redacted for every logger
    assert config["diffrl_tags"] == {"diffrl.run_name": "r"}
    assert "TensorBoard: tensorboard --logdir" in loggers.ui_hint and "W&B: wandb sync" in loggers.ui_hint


def test_a_run_without_mlflow_resumes_from_its_run_folder(run_folder, tmp_path):
    """TensorBoard and W&B only: the run folder's record says which steps every logger took and the validation
    before training, so a resumed process logs neither twice; the steps a crashed process had written past its
    record are hidden in TensorBoard (purge_step) and logged again; W&B continues under the same run id."""
    first = _open(["tensorboard", "wandb"], run_folder)
    _log_a_short_run(first, range(1, 3))
    first.log_values({"critic/rewards/mean": 99.0}, 3)  # then the crash: step 3 reached the files, not the record
    first.finish("FAILED")
    assert json.loads((run_folder / "logged.json").read_text())["step"] == 2
    resumed = _open(["tensorboard", "wandb"], run_folder)
    assert resumed.has_step(2) and not resumed.has_step(3)
    assert resumed.before_training == {"val/reward": 0.25, "val/accuracy": 0.5}
    _log_a_short_run(resumed, range(2, 5))  # step 2 again: already logged, skipped
    resumed.finish()
    assert not (tmp_path / "mlflow.db").exists() and "mlflow_run_id" not in json.loads(
        (run_folder / "run.json").read_text()
    )
    steps = tensorboard_scalars(str(run_folder / "tensorboard"))
    assert steps["critic/rewards/mean"] == [(s, pytest.approx(0.1 * s)) for s in (1, 2, 3, 4)]
    assert steps["val/reward"] == [(0, 0.25)]
    wandb = wandb_scalars(str(run_folder))
    assert [s for s, _ in wandb["perf/time_per_step"]] == [1, 2, 3, 4]
    assert len(list((run_folder / "wandb").glob(f"offline-run-*-{resumed.run_ids['wandb']}*"))) == 2


def test_a_step_mlflow_took_before_a_crash_its_record_missed_is_not_logged_twice(run_folder, tmp_path):
    """Killed after MLflow took step 3's metrics and before the record said so: the resumed process trains step 3
    again and logs it to the loggers that lack it (TensorBoard, which purged it), not to MLflow a second time."""
    first = _open(["mlflow", "tensorboard"], run_folder)
    _log_a_short_run(first, range(1, 3))
    first.loggers["mlflow"].log_values({"critic/rewards/mean": 0.3, "perf/time_per_step": 4.0}, 3)
    first.finish("KILLED")
    assert json.loads((run_folder / "logged.json").read_text())["step"] == 2
    resumed = _open(["mlflow", "tensorboard"], run_folder)
    assert not resumed.has_step(3)
    _log_a_short_run(resumed, range(3, 5))
    resumed.finish()
    mlflow = mlflow_scalars(f"sqlite:///{tmp_path}/mlflow.db", resumed.run_ids["mlflow"])
    assert [s for s, _ in mlflow["critic/rewards/mean"]] == [1, 2, 3, 4]
    assert [s for s, _ in tensorboard_scalars(str(run_folder / "tensorboard"))["critic/rewards/mean"]] == [1, 2, 3, 4]
    assert json.loads((run_folder / "logged.json").read_text())["step"] == 4


def test_an_older_run_without_a_record_takes_what_its_mlflow_run_holds(run_folder, tmp_path):
    """A run folder from before runs/<name>/logged.json existed: its MLflow run says which steps were logged."""
    tracker = Tracker(experiment="loggers", run_name="r", state_path=str(run_folder / "run.json"))
    tracker.log_values({"val/reward": 0.25, "startup_s/total": 3.0}, 0)
    for step in (1, 2):
        tracker.log_values({"perf/time_per_step": 1.0}, step)
    tracker.finish()
    resumed = _open(["mlflow"], run_folder)
    assert resumed.has_step(2) and not resumed.has_step(3) and resumed.before_training == {"val/reward": 0.25}
    resumed.finish()


def test_an_evaluation_keeps_no_record(run_folder):
    loggers = _open(["tensorboard"], run_folder, record=False)
    loggers.log_values({"val/reward": 0.5}, 3)
    loggers.finish()
    assert not (run_folder / "logged.json").exists()
    assert tensorboard_scalars(str(run_folder / "tensorboard")) == {"val/reward": [(3, 0.5)]}


@pytest.mark.parametrize(
    "loggers, message",
    [("[mlflow, tensorbord]", "tensorbord"), ("[mlflow, mlflow]", "'mlflow', 'mlflow'")],
)
def test_run_loggers_names_each_logger_once(loggers, message):
    with pytest.raises(
        ConfigError, match=rf"run.loggers must list each of mlflow, tensorboard, wandb at most once.*{message}"
    ):
        load_experiment(None, [f"run.loggers={loggers}"])


def test_a_missing_logger_package_is_one_line_naming_the_extra(monkeypatch, run_folder):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: its import fails
    with pytest.raises(
        ValueError, match=r"tensorboard needs the tensorboard package.*pip install 'diffrl\[tensorboard\]'"
    ):
        check_logger_packages(["mlflow", "tensorboard"])
    with pytest.raises(ValueError, match=r"pip install 'diffrl\[tensorboard\]'"):
        _open(["tensorboard"], run_folder)


def test_diffrl_train_refuses_a_logger_whose_package_is_missing_before_any_work(tmp_path):
    code = "import sys; sys.modules['wandb'] = None; from diffrl.flows.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "run.loggers=[mlflow, wandb]"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line == (
        "diffrl train: error: run.loggers: wandb needs the wandb package, which is not installed: "
        "pip install 'diffrl[wandb]'"
    )
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
