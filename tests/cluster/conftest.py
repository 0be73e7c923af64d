"""A Prefect server on loopback and a local Ray cluster (2 CPUs, 2 fake GPUs), started by the tests.

Both are started once per session and stopped at the end, by the processes this file started.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from e2e_settings import TINY  # noqa: E402,F401  (re-exported for tests)
from servers import start_prefect_server  # noqa: E402


@pytest.fixture(scope="session")
def _prefect_url(tmp_path_factory):
    """API URL of a fresh loopback Prefect server, started once per session."""
    home = str(tmp_path_factory.mktemp("prefect_home"))
    proc, url = start_prefect_server(home)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def prefect_server(_prefect_url):
    """PREFECT_API_URL of the session's loopback server, set for this process, its threads and its children during
    each test here, and only then: a test elsewhere that the same worker runs later gets Prefect's temporary server.
    (Prefect's settings in a thread come from a global context read from the environment when it was made: it is
    made again on both edges.)"""
    from prefect.context import refresh_global_settings_context

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_API_URL", _prefect_url)
        refresh_global_settings_context()
        try:
            yield _prefect_url
        finally:
            mp.undo()
            refresh_global_settings_context()


@pytest.fixture(scope="session")
def diffrl_cache(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("diffrl_cache"))
    os.environ["DIFFRL_CACHE"] = path
    return path


@pytest.fixture(scope="session")
def ray_cluster(_prefect_url, diffrl_cache, tmp_path_factory):
    """A local Ray cluster owned by this process: 2 CPUs, 4 fake GPUs (placement is real, devices are CPU)."""
    ray = pytest.importorskip("ray")
    # the raylet and its workers inherit this environment: the Prefect server and the tiny-model cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_API_URL", _prefect_url)
        ctx = ray.init(
            num_cpus=2,
            num_gpus=4,
            namespace="diffrl",
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=str(tmp_path_factory.mktemp("ray")),
        )
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture
def workdir(tmp_path, monkeypatch, diffrl_cache):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DIFFRL_INJECT_FAULT", raising=False)
    return tmp_path


@pytest.fixture(autouse=True)
def _no_actors_left_behind():
    """After each test, remove the actors and placement groups of every diffrl run still on the test cluster: a
    test that fails before its own `stop_actors` would otherwise hold the fake GPUs, and the next tests could not
    place theirs (one failure reported as three)."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from diffrl.engines import cluster

    for run_name in sorted({a["name"].rsplit("/", 1)[0] for a in cluster.list_actors()}):
        cluster.stop_actors(run_name)
