"""A user's own Python reward, named `module:function` in the config, in a whole tiny CPU run: reward/<name> is the
function's closed form on the images the run stored; a rerun imports only the rewards the config it is given names,
never one the run recorded (its MLflow config.yaml, or any file of the run folder): a rerun that drops a reward is
refused before anything loads (the stored rewards are the old sum), and the recorded one is not imported."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from e2e_settings import TINY
from mlflow.tracking import MlflowClient

from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.flows.run_config import ConfigChangeRefused
from diffrl.flows.train import train

BRIGHTNESS = "my_rewards:brightness"


def _brightness(images_BHW3: np.ndarray) -> np.ndarray:
    """The closed form of tests/engines/reward/user_modules/my_rewards.brightness: the mean pixel value in [0, 1]."""
    return images_BHW3.reshape(len(images_BHW3), -1).astype(np.float64).mean(1) / 255.0


def test_a_user_reward_is_scored_and_logged_and_a_recorded_one_is_never_imported(
    workdir, user_reward_modules, monkeypatch
):
    marker = workdir / "imports.txt"  # planted_rewards appends a line each time it is imported
    monkeypatch.setenv("DIFFRL_TEST_IMPORT_MARKER", str(marker))
    components = f"[{{name: '{BRIGHTNESS}'}}, {{name: 'planted_rewards:score', weight: 0.0}}]"
    first = train(config=None, overrides=TINY + ["run.steps=1", f"reward.components={components}"])
    assert marker.read_text().count("imported") == 1

    store = TrajectoryStore("runs/quickstart/trajectories.lance")
    images = store.read_step(0, with_latents=False).images.numpy()
    _, stored, valid = store.read_rewards(0)
    assert valid.all() and np.allclose(stored[BRIGHTNESS].numpy(), _brightness(images), atol=1e-6)
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [logged] = client.get_metric_history(first["mlflow_run_id"], f"reward/{BRIGHTNESS}")
    assert logged.step == 1 and logged.value == pytest.approx(_brightness(images).mean(), abs=1e-6)
    recorded = client.download_artifacts(first["mlflow_run_id"], "config.yaml", str(workdir))
    assert "planted_rewards:score" in open(recorded).read()  # the run's record names it

    sys.modules.pop("planted_rewards")  # as a new process: the rerun must not import it again
    with pytest.raises(ConfigChangeRefused, match=r"reward\.components"):
        train(config=None, overrides=TINY + ["run.steps=2", f"reward.components=[{{name: '{BRIGHTNESS}'}}]"])
    assert marker.read_text().count("imported") == 1 and "planted_rewards" not in sys.modules
