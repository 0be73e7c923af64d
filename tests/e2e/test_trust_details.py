"""Smaller trust checks: settings that cannot learn are refused, errors name what they are
about and exit with the code that fits, and MLflow never shows a failed run as RUNNING."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.configs.loader import ConfigError
from diffrl.flows.cli import main
from diffrl.flows.train import train


def _cli(args: list[str], capfd) -> subprocess.CompletedProcess:
    """`diffrl train ARGS` in this process (`main` is what the `diffrl` script calls), its stderr read from fd 2:
    these commands fail before or at their first step, so a fresh interpreter's imports and Prefect server start
    (~20 s a command on the 2-core CI machine) would be most of their time."""
    capfd.readouterr()
    code = main(["train", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["diffrl", "train", *args], code, out, err)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, diffrl_cache):
    """One TINY run of one step (runs/ and mlflow.db), trained once for the tests that damage or resume a copy."""
    folder = tmp_path_factory.mktemp("one_step_run")
    here, tracking = os.getcwd(), os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.chdir(folder)
    try:
        train(config=None, overrides=TINY + ["run.steps=1"])
    finally:
        os.chdir(here)
        if tracking is not None:
            os.environ["MLFLOW_TRACKING_URI"] = tracking
    return folder


@pytest.fixture
def trained(workdir, one_step_run):
    """The working directory holding its own copy of `one_step_run`."""
    shutil.copytree(one_step_run, workdir, dirs_exist_ok=True)
    return workdir


@pytest.mark.parametrize(
    "algorithm, why",
    [
        ("{name: flow_grpo}", "normalises each reward within its prompt's group, so with one sample every advantage"),
        ("{name: dpo}", r"trains on \(chosen, rejected\) pairs of one prompt's samples, and one sample makes no pair"),
    ],
)
def test_group_size_1_is_refused_with_the_algorithms_reason(workdir, algorithm, why):
    """A group of one has every advantage 0: it would train on nothing, silently."""
    overrides = TINY + [f"algorithm={algorithm}", "rollout.group_size=1", "train.mini_batch_prompts=1"]
    with pytest.raises(ConfigError, match=rf"rollout.group_size=1: algorithm '\w+' {why}"):
        train(config=None, overrides=overrides)
    assert not os.path.exists("runs")


def test_a_prompt_file_that_is_not_utf8_is_named(workdir):
    path = workdir / "prompts.txt"
    path.write_bytes(b'a sign that says "open"\na caf\xe9 sign\n')
    with pytest.raises(ValueError, match=rf"{path}: not UTF-8 text \(byte 0xe9 on line 2"):
        train(config=None, overrides=TINY + [f"data.train={path}"])


def test_an_engine_build_error_is_one_line(workdir, capfd):
    """A bad model path fails while the engines are built, inside the flow: diffrl's own one-line error, without
    Prefect's 24-line traceback before it."""
    bad = _cli(TINY + ["model.path=/nonexistent/model"], capfd)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr and "Encountered exception" not in bad.stderr, bad.stderr
    assert bad.stderr.rstrip().splitlines()[-1] == (
        "diffrl train: error: model path '/nonexistent/model' is not a directory (expected a diffusers pipeline folder)"
    )


@pytest.mark.slow
def test_a_lost_lance_data_file_exits_1_and_says_a_rerun_cannot_help(trained, capfd):
    """Exit 2 means bad input, and "rerun the same command" cannot bring a deleted data file back."""
    for path in glob.glob("runs/quickstart/trajectories.lance/data/*.lance"):
        os.remove(path)
    rerun = _cli(TINY + ["run.steps=2"], capfd)
    assert rerun.returncode == 1, rerun.stderr[-2000:]
    last = rerun.stderr.rstrip().splitlines()[-1]
    assert last.startswith("diffrl train: error: run 'quickstart': a file of its stored data is missing (")
    assert "Rerunning cannot bring it back" in last and "rerun the same command" not in rerun.stderr
    assert "Traceback" not in rerun.stderr


def test_a_failure_before_training_leaves_mlflow_failed_not_running(trained):
    """A run killed mid-step leaves its MLflow run RUNNING; a rerun that then fails before training (a validation
    prompt file that no longer exists) must not leave it so: every failed attempt ends FAILED."""
    client = MlflowClient(f"sqlite:///{trained}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    client.update_run(run.info.run_id, status="RUNNING")  # what a kill -9 mid-step leaves
    with pytest.raises(ValueError, match="/nonexistent/prompts.parquet"):
        train(config=None, overrides=TINY + ["run.steps=2", "data.val=/nonexistent/prompts.parquet"])
    assert client.get_run(run.info.run_id).info.status == "FAILED"


def test_evaluate_takes_its_checkpoint_before_retention_can_remove_it(trained):
    """`diffrl evaluate` beside a training run: the checkpoint it evaluates is taken (hard links) before the model
    loads, so the training run's retention removing it meanwhile leaves the evaluation a whole checkpoint. A named
    checkpoint already gone is one line naming it."""
    from diffrl.configs.schema import load_experiment
    from diffrl.engines.train.checkpoint import verify
    from diffrl.flows.evaluate import take_checkpoint

    cfg = load_experiment(None, TINY)
    source, taken = take_checkpoint(cfg, None, str(trained / "pinned"))
    assert source.endswith("checkpoints/step_1") and os.path.realpath(source).startswith(str(trained.resolve()))
    shutil.rmtree(source)  # as the training run's retention would, while the evaluation builds its model
    verify(taken)  # every file there, matching checksums.json
    with pytest.raises(ValueError, match="step_1.*is not a folder"):
        take_checkpoint(cfg, source, str(trained / "again"))
