"""A new sqlite MLflow database seeded from the migrated template (diffrl/flows/mlflow_template.py) is the database
MLflow itself makes: the same schema, revision and rows, its Default experiment in its own folder."""

from __future__ import annotations

import sqlite3

from mlflow.tracking import MlflowClient

from diffrl.flows.mlflow_template import seed_sqlite_store


def _dump(path) -> dict:
    """Schema SQL and every row of every table (the Default experiment's times left out: they are its creation's)."""
    db = sqlite3.connect(path)
    schema = sorted(db.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall())
    rows = {}
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
        rows[table] = sorted(map(repr, db.execute(f'SELECT * FROM "{table}"').fetchall()))
    rows["experiments"] = sorted(db.execute("SELECT experiment_id, name, lifecycle_stage FROM experiments").fetchall())
    locations = db.execute("SELECT artifact_location FROM experiments").fetchall()
    db.close()
    return {"schema": schema, "rows": rows, "locations": locations}


def _open(folder, monkeypatch) -> None:
    """What diffrl does with a run folder's database: seed it, then open it with MLflow, in the folder."""
    monkeypatch.chdir(folder)
    uri = f"sqlite:///{folder}/mlflow.db"
    seed_sqlite_store(uri)
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def test_a_seeded_database_is_the_one_mlflow_makes(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    for name in ("fresh", "seeded", "seeded_again"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "fresh")
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/fresh/mlflow.db").search_experiments(max_results=1)  # MLflow's
    _open(tmp_path / "seeded", monkeypatch)  # makes the template, then copies it
    _open(tmp_path / "seeded_again", monkeypatch)  # copies it
    fresh = _dump(tmp_path / "fresh" / "mlflow.db")
    assert [len(fresh["rows"][t]) for t in ("alembic_version", "experiments", "workspaces")] == [1, 1, 1]
    for name in ("seeded", "seeded_again"):
        seeded = _dump(tmp_path / name / "mlflow.db")
        assert seeded["schema"] == fresh["schema"] and seeded["rows"] == fresh["rows"], name
        assert seeded["locations"] == [(f"{tmp_path}/{name}/mlruns/0",)], name  # its own, not the template's
    assert fresh["locations"] == [(f"{tmp_path}/fresh/mlruns/0",)]
    assert sorted(p.name for p in (tmp_path / "cache" / "mlflow").iterdir() if p.suffix == ".db")[0].startswith(
        "empty-"
    )


def test_an_existing_database_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mlflow.db"
    path.write_bytes(b"not a template")
    seed_sqlite_store(f"sqlite:///{path}")
    seed_sqlite_store("file:///elsewhere")  # not sqlite: nothing to do
    assert path.read_bytes() == b"not a template" and not (tmp_path / "cache").exists()
