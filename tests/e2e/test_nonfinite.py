"""Non-finite training never goes unnoticed: a non-finite setting is refused on load, a NaN loss
skips its optimizer step and shows in MLflow as NaN, and weights that turn non-finite stop the run before they are
checkpointed."""

from __future__ import annotations

import math
import os

import pytest
import torch
from e2e_settings import TINY
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file, save_file

from diffrl.configs.loader import ConfigError
from diffrl.engines.train.checkpoint import NonFiniteWeights, write_checksums
from diffrl.flows.train import train


def _run(workdir):
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])
    return client, run


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=inf", "train.lr"),
        ("rollout.guidance_scale=.nan", "rollout.guidance_scale"),
        ("cluster.actor_timeout_s=-1e999", "cluster.actor_timeout_s"),
        ("algorithm.noise_level=.inf", "algorithm.noise_level"),
    ],
)
def test_a_non_finite_setting_is_refused_by_name_before_any_work(workdir, override, field):
    """train.lr=inf, if accepted, would turn every LoRA weight into NaN after one step and exit 0."""
    with pytest.raises(ConfigError, match=rf"{field} must be a finite number, got (-?inf|nan)"):
        train(config=None, overrides=TINY + [override])
    assert not os.path.exists("runs/quickstart")


def test_a_nan_loss_skips_its_optimizer_step_and_is_logged_as_nan(workdir, monkeypatch):
    """The fault point `loss@2:nan` makes step 2's loss NaN: its optimizer step is skipped (actor/skipped_steps 1),
    actor/pg_loss reaches MLflow as NaN (not dropped), the weights stay finite, the run ends."""
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "loss@2:nan")
    assert train(config=None, overrides=TINY + ["run.steps=2"])["last_step"] == 2
    client, run = _run(workdir)
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")}
    skipped = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "actor/skipped_steps")}
    assert sorted(loss) == [1, 2] and math.isfinite(loss[1]) and math.isnan(loss[2])
    assert skipped == {1: 0.0, 2: 1.0}
    weights = load_file("runs/quickstart/checkpoints/step_2/trainable.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_weights_that_turn_non_finite_stop_the_run_before_their_checkpoint(workdir):
    """A checkpoint that holds NaN in one LoRA tensor and checksums that match it (what a learning rate that overflows
    the weights leaves) must not train on to "done", exit 0, with NaN weights: step 2's update stops it with an error
    naming the step and a tensor, before step 2's checkpoint, and MLflow says FAILED."""
    train(config=None, overrides=TINY + ["run.steps=1"])
    folder = "runs/quickstart/checkpoints/step_1"
    weights = load_file(f"{folder}/trainable.safetensors")
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], math.nan)
    save_file(weights, f"{folder}/trainable.safetensors")
    write_checksums(folder)
    with pytest.raises(NonFiniteWeights, match=r"step 2: after the update [1-9]\d* of the policy's \d+ trainable"):
        train(config=None, overrides=TINY + ["run.steps=2"])
    assert not os.path.exists("runs/quickstart/checkpoints/step_2")
    assert _run(workdir)[1].info.status == "FAILED"
