"""The run's MLflow tracker (diffrl/flows/tracking.py)."""

from __future__ import annotations

import math
import sys

from mlflow.tracking import MlflowClient

from diffrl.flows.tracking import Tracker


def test_non_finite_metrics_are_logged_as_such(tmp_path, monkeypatch):
    """A NaN loss or an infinite gradient norm is what a user must see in MLflow (issue 27, item 3): they used to
    be dropped, so the charts showed nothing wrong."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    tracker = Tracker(experiment="nan", run_name="nan", state_path=str(tmp_path / "run.json"))
    tracker.log_metrics({"actor/pg_loss": math.nan, "actor/grad_norm": math.inf, "critic/rewards/mean": 0.5}, 1)
    tracker.finish()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    values = {
        key: [m.value for m in client.get_metric_history(tracker.run_id, key)]
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/rewards/mean")
    }
    assert len(values["actor/pg_loss"]) == 1 and math.isnan(values["actor/pg_loss"][0])
    assert values["actor/grad_norm"] == [sys.float_info.max]  # how MLflow's database stores +inf
    assert values["critic/rewards/mean"] == [0.5]


def test_the_experiment_is_a_model_training_one_and_images_are_stepped_and_captioned(tmp_path, monkeypatch):
    """MLflow 3 showed the experiment on its GenAI pages and the images as one 256x64 strip per step file (issue 28,
    item 1): the experiment now carries the model-training kind, and images are logged under a key with a step (the
    UI's step slider), each sample enlarged to 256 px with its reward and prompt under it."""
    import numpy as np

    from diffrl.flows.tracking import EXPERIMENT_KIND_TAG, MODEL_TRAINING, caption, image_grid

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    tracker = Tracker(experiment="kind", run_name="kind", state_path=str(tmp_path / "run.json"))
    images = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    grid = image_grid(images, [caption("two red circles", 0.5), caption("a cat", float("nan")), "c", "d"])
    assert grid.shape == (256 + 30, 4 * 256, 3)  # 64 px tiles enlarged 4x, a caption band under them
    assert (grid[256:, :256] < 128).any() and not (grid[256:, 3 * 256 :] < 128).all()  # text was drawn
    assert caption("a cat", float("nan")) == "excluded: a cat"
    for step in (1, 2):
        tracker.log_images(images, ["a", "b", "c", "d"], "rollout", step)
    tracker.finish()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_experiment_by_name("kind").tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    names = [a.path for a in client.list_artifacts(tracker.run_id, "images")]
    assert sum("rollout" in n and "step%2B1" in n.replace("+", "%2B") for n in names) >= 1, names
    assert sum("rollout" in n and "step%2B2" in n.replace("+", "%2B") for n in names) >= 1, names
