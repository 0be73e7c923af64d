"""diffrl/flows/early.py: what `diffrl train` prepares while Prefect's server boots is taken by the flow only for
exactly the config it was made for, once; a config that fails to build leaves nothing behind (the flow builds again
and reports the error itself)."""

from __future__ import annotations

import os
import sys

import pytest

from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.flows import early

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e"))
from e2e_settings import TINY  # noqa: E402  (the whole-flow tests' tiny experiment)


@pytest.fixture
def tiny_cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    return lambda *more: load_experiment("quickstart", [*TINY, f"run.root={tmp_path}/runs", "run.name=early", *more])


def test_the_flow_takes_the_prepared_engines_and_validation_for_its_own_config_once(tiny_cfg):
    cfg = tiny_cfg()
    made = []
    parts = early.prepare(
        cfg, lambda engines: made.append(engines) or ("samples", {"val/reward": 0.5}, [0.5]), fresh=True
    )
    assert set(parts) == {"engines", "validation"} and all(seconds >= 0 for seconds in parts.values())
    engines = early.take_engines(tiny_cfg())  # the flow loads the same config again: an equal, not the same, object
    assert engines is made[0] and cluster.get("early") is engines
    assert early.take_validation("early") == ("samples", {"val/reward": 0.5}, [0.5])
    assert early.take_engines(cfg) is None and early.take_validation("early") is None  # taken once
    engines.memory.close()
    cluster.drop("early")


def test_another_config_or_a_failed_build_gets_nothing(tiny_cfg):
    cfg = tiny_cfg()
    assert early.prepare(cfg, lambda engines: None, fresh=False) == pytest.approx({"engines": 0.0}, abs=1e3)
    assert early.take_engines(tiny_cfg("train.lr=2.0e-4")) is None  # an override changed: the flow builds its own
    assert early.take_validation("early") is None  # a run with a checkpoint validates after loading it
    broken = tiny_cfg("model.path=/nonexistent/model")
    assert early.prepare(broken, lambda engines: None, fresh=True) == {}
    assert early.take_engines(broken) is None
    with pytest.raises(RuntimeError, match="no engines for run 'early'"):
        cluster.get("early")
