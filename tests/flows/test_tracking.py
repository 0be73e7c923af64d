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
