"""A new sqlite MLflow database starts as a copy of an empty one already migrated, instead of migrating from scratch.

MLflow creates a missing sqlite database by running every schema migration (~50 alembic revisions): 1.1-2 s on the
2-core CI machine, paid by every new run folder (each `diffrl train` in a fresh working directory, most tests).
The template is made once per MLflow version under the diffrl cache (DIFFRL_CACHE): a database MLflow itself
created and migrated, with its Default experiment removed. MLflow opening the copy finds every table at its head
revision, and creates the Default experiment there as in any new database (its artifact location is the copy's
own, not the template's). Only a database that does not exist yet is seeded, never one over another.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sqlite3
import tempfile
import threading

import mlflow
from mlflow.tracking import MlflowClient

log = logging.getLogger("diffrl")
SQLITE = "sqlite:///"


def seed_sqlite_store(uri: str) -> None:
    """When `uri` is `sqlite:///<path>` and nothing is at <path> yet, put a copy of the migrated template there.

    Anything that goes wrong here is logged and left to MLflow, which then creates the database as it always does."""
    if not uri.startswith(SQLITE):
        return
    path = uri[len(SQLITE) :]
    if os.path.exists(path) or not os.path.isdir(os.path.dirname(path) or "."):
        return
    tmp = None
    try:
        template = _template()
        # a name of its own for each call: two threads of one process (the command's early open and the flow's
        # Tracker) may seed the same database at once, and a shared name would rewrite the file one of them linked
        fd, tmp = tempfile.mkstemp(
            prefix=os.path.basename(path) + ".", suffix=".seed", dir=os.path.dirname(path) or "."
        )
        os.close(fd)
        shutil.copyfile(template, tmp)
        os.link(tmp, path)  # fails where a database appeared meanwhile: never over another process's
    except FileExistsError:
        pass
    except (OSError, sqlite3.Error, mlflow.exceptions.MlflowException) as e:
        log.debug("no MLflow template for %s (%s): MLflow creates it", path, e)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def _template() -> str:
    """The empty migrated database of this MLflow version, made on first use (file-locked, renamed into place)."""
    from diffrl.flows.build import cache_dir

    folder = os.path.join(cache_dir(), "mlflow")
    path = os.path.join(folder, f"empty-{mlflow.__version__}.db")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            MlflowClient(tracking_uri=SQLITE + tmp).search_experiments(max_results=1)  # MLflow migrates it
            with sqlite3.connect(tmp) as db:  # MLflow makes the Default experiment of each copy itself
                db.execute("DELETE FROM experiments")
            db.close()
            os.replace(tmp, path)
    return path
