"""A run whose folder is on an S3-compatible object store (moto's server on loopback), trained and resumed through
fsspec and Lance with one `run.storage_options`: nothing of the run folder but the lock, Prefect's results and the
trace lands on the local disk."""

from __future__ import annotations

import json

import pytest
from e2e_settings import TINY
from object_store import BUCKET, SECRET, moto_server, run_overrides, s3, storage_options

from diffrl.flows.train import train


@pytest.fixture
def s3_endpoint():
    with moto_server() as endpoint:
        yield endpoint


def test_train_and_resume_on_s3(workdir, s3_endpoint):
    run = [*TINY, *run_overrides(s3_endpoint, "s3run")]
    first = train(config=None, overrides=[*run, "run.steps=2"])
    assert first["last_step"] == 2
    resumed = train(config=None, overrides=[*run, "run.steps=3"])
    assert resumed["last_step"] == 3

    store = s3(s3_endpoint)
    folder = f"{BUCKET}/runs/s3run"
    assert json.loads(store.cat(f"{folder}/checkpoints/latest.json"))["step"] == 3
    for step in (2, 3):  # the latest two checkpoints are kept, each whole
        files = {p.rsplit("/", 1)[-1] for p in store.find(f"{folder}/checkpoints/step_{step}")}
        assert {"checksums.json", "stored_rows.json", "trainer_state.json", "update_metrics.json"} <= files
    assert not store.exists(f"{folder}/checkpoints/step_3.tmp")
    record = json.loads(store.cat(f"{folder}/checkpoints/step_3/stored_rows.json"))["rows"]
    assert record == {"1": 8, "2": 8, "3": 8}
    assert store.exists(f"{folder}/run.json")
    for table in ("trajectories", "rewards", "advantages"):
        assert store.find(f"{folder}/{table}.lance"), table
    # the local disk holds only what the driver reads itself
    assert sorted(p.name for p in (workdir / "runs" / "s3run").iterdir()) == ["prefect", "run.lock"]
    assert not (workdir / "s3:").exists()
    _each_step_once(s3_endpoint)
    _no_secret_in_mlflow(workdir, resumed["mlflow_run_id"])


def _no_secret_in_mlflow(workdir, run_id: str) -> None:
    """The storage options' keys reach MLflow's params as *** (diffrl/engines/redact.py)."""
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}").get_run(run_id).data.params
    logged = {k: v for k, v in params.items() if "storage_options" in k}
    # neither the secret nor the access key id ("moto", once the secret "moto-secret-key" is left out)
    assert logged and not any(SECRET in v or "moto" in v.replace("moto-", "") for v in logged.values()), logged


def _each_step_once(endpoint: str) -> None:
    """Every step's rows are in trajectories.lance once: the resume wrote step 3 and nothing of steps 1 and 2 again."""
    import lance

    rows = lance.dataset(f"s3://{BUCKET}/runs/s3run/trajectories.lance", storage_options=storage_options(endpoint))
    steps = rows.to_table(columns=["step", "group_id", "sample_index"]).to_pylist()
    keys = [(r["step"], r["group_id"], r["sample_index"]) for r in steps]
    assert len(keys) == len(set(keys)) == 24
    assert sorted({r["step"] for r in steps}) == [1, 2, 3]
