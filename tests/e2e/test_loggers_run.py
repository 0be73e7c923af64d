"""`run.loggers` in whole tiny CPU runs: TensorBoard's event files and W&B's offline run hold every metric MLflow gets,
under the same names at the same steps; a run logged without MLflow resumes after a failure and after a crash, its
run folder saying what was logged. W&B runs offline (WANDB_MODE unset: diffrl's default): there is no network here."""

from __future__ import annotations

import json

import pytest
from e2e_settings import TINY
from logged_files import assert_same_scalars, mlflow_scalars, tensorboard_images, tensorboard_scalars, wandb_scalars

from diffrl.flows.evaluate import evaluate
from diffrl.flows.train import train

pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install 'diffrl[tensorboard]'")
pytest.importorskip("wandb", reason="the wandb extra: pip install 'diffrl[wandb]'")

RUN = "runs/quickstart"


def test_tensorboard_and_wandb_get_every_metric_mlflow_gets(workdir, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    result = train(config=None, overrides=TINY + ["run.steps=2", "run.loggers=[mlflow, tensorboard, wandb]"])
    mlflow = mlflow_scalars(f"sqlite:///{workdir}/mlflow.db", result["mlflow_run_id"])
    expected = {"critic/rewards/mean", "actor/pg_loss", "actor/grad_norm", "reward/jpeg_compressibility"}
    assert expected | {"perf/throughput", "timing_s/generate", "val/reward", "startup_s/total"} <= set(mlflow)
    assert [step for step, _ in mlflow["critic/rewards/mean"]] == [1, 2]
    assert_same_scalars(mlflow, tensorboard_scalars(f"{RUN}/tensorboard"), "tensorboard")
    assert_same_scalars(mlflow, wandb_scalars(RUN), "wandb")
    images = tensorboard_images(f"{RUN}/tensorboard")
    assert [step for step, *_ in images["validation"]] == [0, 2] and [s for s, *_ in images["rollout"]] == [1, 2]
    assert result["wandb_run_id"] == json.loads((workdir / RUN / "run.json").read_text())["wandb_run_id"]


def test_a_run_logged_only_to_tensorboard_resumes_after_a_failure_and_evaluates(workdir, monkeypatch):
    overrides = TINY + ["run.loggers=[tensorboard]"]
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "update_actor@2")
    with pytest.raises(Exception, match="injected fault"):
        train(config=None, overrides=overrides)
    assert json.loads((workdir / RUN / "logged.json").read_text())["step"] == 1
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    result = train(config=None, overrides=overrides)
    assert result["last_step"] == 3 and "mlflow_run_id" not in result
    scalars = tensorboard_scalars(f"{RUN}/tensorboard")
    for key in ("critic/rewards/mean", "perf/time_per_step", "actor/grad_norm"):
        assert [step for step, _ in scalars[key]] == [1, 2, 3], key
    assert [step for step, _ in scalars["val/reward"]] == [0, 3]  # the validation before training: once
    assert json.loads((workdir / RUN / "logged.json").read_text())["step"] == 3
    assert "mlflow_run_id" not in json.loads((workdir / RUN / "run.json").read_text())
    evaluated = evaluate(config=None, overrides=overrides)  # its own run: runs/<name>/eval/tensorboard
    assert tensorboard_scalars(f"{RUN}/eval/tensorboard")["val/reward"] == [(3, pytest.approx(evaluated["val/reward"]))]
    assert not (workdir / "mlflow.db").exists() and not (workdir / "mlartifacts").exists()


@pytest.mark.slow
def test_a_crash_after_a_checkpoint_logs_its_step_once_without_mlflow(workdir, capfd):
    """The process dies after step 2's checkpoint committed but before its metrics were logged (as in
    tests/e2e/test_kill_resume.py): the record says step 1, so the rerun logs step 2 once, then step 3."""
    from test_kill_resume import _diffrl, _rerun

    overrides = TINY + ["run.loggers=[tensorboard]"]
    killed = _diffrl(overrides, workdir, DIFFRL_INJECT_FAULT="sync_weights@2:stall")
    assert killed.returncode == 137, killed.stderr[-2000:]
    assert json.loads((workdir / RUN / "logged.json").read_text())["step"] == 1
    done = _rerun(overrides, capfd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming after step 2" in done.stderr and "TensorBoard: tensorboard --logdir" in done.stderr
    scalars = tensorboard_scalars(str(workdir / RUN / "tensorboard"))
    assert [step for step, _ in scalars["critic/rewards/mean"]] == [1, 2, 3]
    assert not (workdir / "mlflow.db").exists()
