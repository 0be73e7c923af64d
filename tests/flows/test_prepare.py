"""What `diffrl train` prepares while Prefect's server boots (diffrl/flows/commands/train.py `prepare`): the engines,
registered under the run name, and their validation before training, taken by the train flow only for exactly the
config they were built from, once; a config that fails to build leaves nothing behind (the flow builds again and
reports the error itself)."""

from __future__ import annotations

import os
import sys

import pytest

from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.flows.commands.train import prepare
from diffrl.flows.train import take_prepared

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e"))
from e2e_settings import TINY  # noqa: E402  (the whole-flow tests' tiny experiment)


@pytest.fixture
def tiny_cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    return lambda *more: load_experiment("quickstart", [*TINY, f"run.root={tmp_path}/runs", "run.name=early", *more])


def test_the_flow_takes_the_prepared_engines_and_validation_for_its_own_config_once(tiny_cfg):
    cfg = tiny_cfg()
    parts = prepare(cfg)
    assert set(parts) == {"engines", "validation"} and all(seconds >= 0 for seconds in parts.values())
    made = cluster.get("early")
    traj, metrics, scores = made.validation_before_training
    assert len(scores) == cfg.data.num_val_prompts * cfg.data.val_samples_per_prompt and "val/reward" in metrics
    engines, validation = take_prepared(tiny_cfg())  # the flow loads the same config again: equal, not the same
    assert engines is made and cluster.get("early") is engines
    assert validation[1] == metrics and validation[2] == scores
    assert take_prepared(cfg) == (engines, None)  # the validation is taken once
    engines.memory.close()
    cluster.drop("early")


def test_another_config_or_a_failed_build_gets_nothing(tiny_cfg):
    cfg = tiny_cfg("data.num_val_prompts=0")
    assert prepare(cfg) == pytest.approx({"engines": 0.0}, abs=1e3)  # nothing to validate
    assert take_prepared(tiny_cfg("data.num_val_prompts=0", "train.lr=2.0e-4")) == (None, None)  # the flow builds
    broken = tiny_cfg("model.path=/nonexistent/model")
    assert prepare(broken) == {}
    assert take_prepared(broken) == (None, None)
    with pytest.raises(RuntimeError, match="no engines for run 'early'"):
        cluster.get("early")
