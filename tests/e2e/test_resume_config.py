"""A rerun with another config: a change the run's stored data cannot take is refused before anything loads, with
every such field's old and new value; any other change is applied whole (the learning rate too, which the optimizer's
saved state would bring back) and recorded in MLflow; `run.init_from` starts a new run from another run's weights."""

from __future__ import annotations

import pytest
import yaml
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.flows.cli import main
from diffrl.flows.run_config import ConfigChangeRefused
from diffrl.flows.train import train

ONE_STEP = [*TINY, "run.steps=1"]  # lr 3e-3, LoRA rank 16, group size 4


def _run(workdir, name: str):
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("diffrl-quickstart").experiment_id
    [run] = client.search_runs([experiment], filter_string=f"tags.`diffrl.run_name` = '{name}'")
    return client, run


def _metric(client, run, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def test_a_resume_refuses_what_the_stored_data_fixes_and_applies_the_rest(workdir, capsys):
    """The lr change was dropped (the optimizer's state restored the old lr) while the group size change was taken;
    MLflow showed the old values."""
    train(config=None, overrides=ONE_STEP)
    capsys.readouterr()
    assert main(["train", *ONE_STEP, "rollout.group_size=2", "train.lora_rank=8"]) == 2  # before Prefect starts
    assert capsys.readouterr().err.rstrip().splitlines() == [
        "diffrl train: error: run 'quickstart' (runs/quickstart) holds stored data that these changed fields would "
        "contradict (old -> new), so it cannot resume with them:",
        "  rollout.group_size: 4 -> 2",
        "  train.lora_rank: 16 -> 8",
        "Rerun without these changes to resume it, or train a new run under another run.name",
    ]
    with pytest.raises(ConfigChangeRefused, match=r"\n  run.seed: 0 -> 1\nRerun .* run.init_from=quickstart$"):
        train(config=None, overrides=[*ONE_STEP, "run.seed=1"])
    client, run = _run(workdir, "quickstart")
    assert run.info.status == "FINISHED"  # a refused rerun leaves the run as it was

    capsys.readouterr()
    train(config=None, overrides=[*TINY, "run.steps=2", "train.lr=1.0e-2", "train.max_grad_norm=0.5"])
    said = capsys.readouterr().err
    assert "config changed since the run last started, applied from step 2: " in said
    assert "run.steps: 1 -> 2, train.lr: 0.003 -> 0.01, train.max_grad_norm: 1.0 -> 0.5" in said
    client, run = _run(workdir, "quickstart")
    assert _metric(client, run, "actor/lr") == {1: pytest.approx(3e-3), 2: pytest.approx(1e-2)}
    assert run.data.params["train.lr"] == "0.003"  # MLflow params cannot change: the tag and the artifact say it
    assert run.data.tags["diffrl.config_changed_at_step"] == "2"
    assert run.data.tags["diffrl.config_changes"].startswith("run.steps: 1 -> 2; train.lr: 0.003 -> 0.01")
    with open(client.download_artifacts(run.info.run_id, "config/step_2.yaml", str(workdir))) as f:
        changed = yaml.safe_load(f)
    assert changed["train"]["lr"] == 0.01
    assert yaml.safe_load((workdir / "runs/quickstart/config.yaml").read_text())["train"]["lr"] == 0.01


def test_init_from_starts_a_new_run_from_another_runs_weights(workdir):
    with pytest.raises(ValueError, match=r"^run.init_from='source': runs/source has no checkpoint \(no checkpoints/"):
        train(config=None, overrides=[*ONE_STEP, "run.name=warm", "run.init_from=source"])
    train(config=None, overrides=[*ONE_STEP, "run.name=source"])
    with pytest.raises(
        ValueError,
        match=r"^run.init_from='source': that run's weights do not fit this config \(train.lora_rank: 16 -> 8\)",
    ):
        train(config=None, overrides=[*ONE_STEP, "run.name=warm", "run.init_from=source", "train.lora_rank=8"])

    train(config=None, overrides=[*ONE_STEP, "run.name=warm", "run.init_from=runs/source"])
    client, source = _run(workdir, "source")
    _, warm = _run(workdir, "warm")
    assert warm.data.tags["diffrl.init_from"] == "runs/source/checkpoints/step_1"
    # validation before training shows the source's trained weights: its validation after its step, to the bit
    assert _metric(client, warm, "val/reward")[0] == _metric(client, source, "val/reward")[1]
    assert _metric(client, warm, "val/reward")[0] != _metric(client, source, "val/reward")[0]
    state = yaml.safe_load((workdir / "runs/warm/checkpoints/step_1/trainer_state.json").read_text())
    assert state["step"] == 1 and state["updates"] == 1  # a new run's first step, on a new optimizer
