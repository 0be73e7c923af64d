"""A new sqlite MLflow database seeded from the migrated template (diffrl/flows/mlflow_template.py) is the database
MLflow itself makes: the same schema, revision and rows, its Default experiment in its own folder."""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor

import pytest
from mlflow.tracking import MlflowClient

from diffrl.flows.mlflow_template import seed_sqlite_store


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One diffrl cache for the module: its template is made once (an MLflow migration, seconds)."""
    return tmp_path_factory.mktemp("cache")


def _dump(path) -> dict:
    """Schema SQL and every row of every table (the Default experiment's times left out: they are its creation's)."""
    db = sqlite3.connect(path)
    schema = sorted(
        (kind, name, _clauses(sql))
        for kind, name, sql in db.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
    )
    rows = {}
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
        rows[table] = sorted(map(repr, db.execute(f'SELECT * FROM "{table}"').fetchall()))
    rows["experiments"] = sorted(db.execute("SELECT experiment_id, name, lifecycle_stage FROM experiments").fetchall())
    locations = db.execute("SELECT artifact_location FROM experiments").fetchall()
    db.close()
    return {"schema": schema, "rows": rows, "locations": locations}


def _clauses(sql: str | None) -> list[str]:
    """A CREATE statement's lines as a sorted list: MLflow's own migrations write a table's CONSTRAINT clauses in
    another order in the first database a process makes than in the next ones (alembic's batch rebuilds)."""
    return sorted(line.strip().rstrip(",").strip() for line in (sql or "").splitlines())


def _open(folder, monkeypatch) -> None:
    """What diffrl does with a run folder's database: seed it, then open it with MLflow, in the folder."""
    monkeypatch.chdir(folder)
    uri = f"sqlite:///{folder}/mlflow.db"
    seed_sqlite_store(uri)
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def test_a_seeded_database_is_the_one_mlflow_makes(tmp_path, monkeypatch, cache):
    monkeypatch.setenv("DIFFRL_CACHE", str(cache))
    for name in ("fresh", "seeded", "seeded_again"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "fresh")
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/fresh/mlflow.db").search_experiments(max_results=1)  # MLflow's
    _open(tmp_path / "seeded", monkeypatch)  # makes the template (the module's first), then copies it
    _open(tmp_path / "seeded_again", monkeypatch)  # copies it
    fresh = _dump(tmp_path / "fresh" / "mlflow.db")
    assert [len(fresh["rows"][t]) for t in ("alembic_version", "experiments", "workspaces")] == [1, 1, 1]
    for name in ("seeded", "seeded_again"):
        seeded = _dump(tmp_path / name / "mlflow.db")
        assert seeded["schema"] == fresh["schema"] and seeded["rows"] == fresh["rows"], name
        assert seeded["locations"] == [(f"{tmp_path}/{name}/mlruns/0",)], name  # its own, not the template's
    assert fresh["locations"] == [(f"{tmp_path}/fresh/mlruns/0",)]
    assert [p.name.startswith("empty-") for p in (cache / "mlflow").iterdir() if p.suffix == ".db"] == [True]


def test_threads_seeding_one_database_at_once_leave_one_whole_copy(tmp_path, monkeypatch, cache):
    """The command's early open and the flow's Tracker may seed the same new database at once."""
    monkeypatch.setenv("DIFFRL_CACHE", str(cache))
    (tmp_path / "run").mkdir()
    seed_sqlite_store(f"sqlite:///{tmp_path}/first.db")  # the template (made here when this test runs alone)
    template = next((cache / "mlflow").glob("empty-*.db")).read_bytes()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: seed_sqlite_store(f"sqlite:///{tmp_path}/run/mlflow.db"), range(8)))
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["mlflow.db"]  # no temporary copies left
    assert (tmp_path / "run" / "mlflow.db").read_bytes() == template


def test_an_existing_database_is_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFRL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mlflow.db"
    path.write_bytes(b"not a template")
    seed_sqlite_store(f"sqlite:///{path}")
    seed_sqlite_store("file:///elsewhere")  # not sqlite: nothing to do
    assert path.read_bytes() == b"not a template" and not (tmp_path / "cache").exists()
