"""The run's MLflow tracker (diffrl/flows/tracking.py)."""

from __future__ import annotations

import math
import sys

from mlflow.tracking import MlflowClient

from diffrl.flows.tracking import Tracker


def test_non_finite_metrics_are_logged_as_such(tmp_path, monkeypatch):
    """A NaN loss or an infinite gradient norm is what a user must see in MLflow: dropped, they would
    leave charts that show nothing wrong."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    tracker = Tracker(experiment="nan", run_name="nan", state_path=str(tmp_path / "run.json"))
    tracker.log_values({"actor/pg_loss": math.nan, "actor/grad_norm": math.inf, "critic/rewards/mean": 0.5}, 1)
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
    """MLflow 3 opens an experiment on its GenAI pages unless it carries the model-training kind, and shows images
    stepped only when they are logged under a key with a step (the UI's step slider): both are set, and each sample
    is enlarged to 256 px with its reward and prompt under it."""
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


def test_the_logged_config_params_and_tags_hold_no_secret(tmp_path, monkeypatch):
    """A run whose config carries storage credentials, a URL with a user's token and a scorer token in a query
    string, started in a checkout whose remote has a token: MLflow's params, config.yaml and tags have none of them,
    and the rest of the config is logged as it was."""
    import subprocess

    import yaml

    from diffrl.configs.loader import to_dict
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.provenance import source_tags

    cfg = load_experiment(
        None,
        [
            "run.storage_options={key: AKIA1, secret: SK2, client_kwargs: {endpoint_url: 'https://minio:PW3@m.example'}}",
            "data.train=https://user:TOKEN4@example.com/prompts.jsonl",
            "reward.components=[{name: http_scorer, options: {url: 'https://s.example/score?token=TOKEN5', "
            "api_key_env: SCORER_KEY}}]",
        ],
    )
    subprocess.run(["git", "init", "-q", str(tmp_path / "checkout")], check=True)
    git = ["git", "-C", str(tmp_path / "checkout")]
    subprocess.run([*git, "remote", "add", "origin", "https://user:TOKEN6@example.com/x.git"], check=True)
    subprocess.run(
        [*git, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "x", "--allow-empty"], check=True
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    tracker = Tracker(experiment="secrets", run_name="secrets", state_path=str(tmp_path / "run.json"))
    tracker.log_config(to_dict(cfg), file_config=to_dict(load_experiment(None)))
    tracker.set_tags(source_tags("my.yaml", cwd=str(tmp_path / "checkout")))
    tracker.finish()

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(tracker.run_id)
    path = client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path))
    with open(path) as f:
        logged_yaml = f.read()
    recorded = [logged_yaml, *run.data.params.values(), *run.data.tags.values()]
    secrets = ["AKIA1", "SK2", "PW3", "TOKEN4", "TOKEN5", "TOKEN6"]
    assert [s for s in secrets if any(s in text for text in recorded)] == []
    assert run.data.params["run.storage_options.key"] == "***"
    assert run.data.params["data.train"] == "https://***@example.com/prompts.jsonl"
    assert run.data.tags["mlflow.source.git.repoURL"] == "https://***@example.com/x.git"
    logged = yaml.safe_load(logged_yaml)
    assert logged["reward"]["components"][0]["options"] == {
        "url": "https://s.example/score?token=***",
        "api_key_env": "SCORER_KEY",
    }
    assert logged["run"]["steps"] == cfg.run.steps and logged["model"] == to_dict(cfg)["model"]


def test_the_params_are_the_key_ones_and_what_the_run_changed(tmp_path, monkeypatch):
    """Every config key as a param (~130) filled MLflow's image cards with `key=value` text above the images: the
    params are KEY_PARAMS and what the run's overrides changed from its config file; config.yaml holds all of it."""
    import yaml

    from diffrl.configs.loader import to_dict
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.tracking import KEY_PARAMS

    cfg = load_experiment(None, ["train.max_grad_norm=0.25", "run.steps=7"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    tracker = Tracker(experiment="params", run_name="params", state_path=str(tmp_path / "run.json"))
    tracker.log_config(to_dict(cfg), file_config=to_dict(load_experiment(None)))
    tracker.finish()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    params = client.get_run(tracker.run_id).data.params
    assert sorted(params) == sorted({*KEY_PARAMS, "train.max_grad_norm"})
    assert params["run.steps"] == "7" and params["train.max_grad_norm"] == "0.25"
    assert params["algorithm.name"] == cfg.algorithm.name and params["model.path"] == cfg.model.path
    with open(client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path))) as f:
        assert yaml.safe_load(f) == to_dict(cfg)
