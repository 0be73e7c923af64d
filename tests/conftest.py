"""Shared fixtures: tiny offline pipelines, built once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Prefect's temporary server logs "Stopping temporary server" at interpreter exit, after pytest has
# closed its capture streams; at WARNING that line (and a logging traceback after the summary) goes.
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# a busy 2-core machine (two workers, servers of other tests) can take longer than Prefect's 20 s to start one
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@pytest.fixture(scope="session", autouse=True)
def _diffrls_temporary_server():
    """The temporary Prefect server of this test process is the one `diffrl train` makes (diffrl/flows/
    prefect_server.py: bound to this process, no event feed stored), whichever test needs one first: a test that runs
    the train flow without the command, or asks Prefect's client for a server, would otherwise make Prefect's own for
    the rest of the worker, and the tests that read what diffrl's stores would read another server's."""
    from diffrl.flows.prefect_server import server_class

    server_class()()  # registered (Prefect keeps one instance per port), started when first used
    yield


@pytest.fixture(autouse=True)
def _own_environment():
    """Each test gets the environment as it was before it and leaves it so: an in-process `diffrl` command sets
    variables for the libraries it quiets (DIFFRL_VERBOSE, PREFECT_LOGGING_LOGGERS_*, HF_HUB_DISABLE_PROGRESS_BARS),
    which would reach the later tests of this worker and every process they start (a Prefect worker whose flow run then
    logged no traceback)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Tests that share one process-wide resource run on one pytest-xdist worker (`make test` runs two, `--dist
# loadgroup`): the Ray cluster tests (one local cluster, its fake GPUs and named actors) and the vLLM tests (one
# cached venv, CPU-heavy servers); every other test file is one unit too, so that its module fixtures are set up once.
# xdist 3.8's own loadgroup marks a group by rewriting `item._nodeid`, which pytest 9.2 does not read (its node ids are
# `item._id`), so its marks group nothing and each module fixture would be set up on both workers. So the scheduler
# groups here, by folder and file, from the node ids it is given.
XDIST_GROUPS = {"cluster": "ray", "vllm": "vllm"}
# The folders whose tests start processes and servers (tens of seconds to minutes each) are handed out first, the
# many short unit-test files after them: a long test handed out last would run alone on one worker while the other
# idles. xdist's own order (most tests first) put the single-test e2e files, the longest, at the end of the queue.
HEAVY_FIRST = ("cluster", "vllm", "e2e", "benchmarks")


def heavy_first(units: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """xdist's work units (scope, {nodeid: done}) with those under HEAVY_FIRST first; otherwise in the given order
    (xdist's: most tests first)."""

    def light(unit: tuple[str, dict]) -> bool:
        parts = next(iter(unit[1])).split("::")[0].split("/")
        return not (len(parts) > 2 and parts[0] == "tests" and parts[1] in HEAVY_FIRST)

    return sorted(units, key=light)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: xdist's scope scheduler with the scopes above, handed out heavy folders first (other --dist
    modes: xdist's own)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedResourceScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            parts = path.split("/")
            if len(parts) > 2 and parts[0] == "tests":
                return XDIST_GROUPS.get(parts[1], path)
            return path

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "heavy_first", False):  # the first assignment: the queue is complete
                units = heavy_first(list(self.workqueue.items()))
                self.workqueue.clear()
                self.workqueue.update(units)
                self.heavy_first = True
            super()._assign_work_unit(node)

    return SharedResourceScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch) -> path of a tiny diffusers folder for `arch`, built once per session (seed 0)."""
    from diffrl.models.tiny import build_tiny

    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny(arch, str(tmp_path_factory.mktemp(f"tiny_{arch}")), seed=0)
        return built[arch]

    return get


@pytest.fixture
def sine_wav(tmp_path):
    """sine_wav(name, freq, ...) -> path of a 16-bit PCM WAV of amplitude x sin(2 pi freq t), written with `wave`."""
    import wave

    import numpy as np

    def write(name: str, freq: float, *, seconds: float = 0.5, rate: int = 16000, amplitude: float = 0.5) -> str:
        t = np.arange(int(seconds * rate)) / rate
        samples = np.round(amplitude * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
        path = str(tmp_path / name)
        with wave.open(path, "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(rate)
            f.writeframes(samples.tobytes())
        return path

    return write


@pytest.fixture
def user_reward_modules(monkeypatch):
    """tests/engines/reward/user_modules (a user's own reward modules) on sys.path and PYTHONPATH, as docs/rewards.md
    tells a user to put theirs; afterwards the modules are forgotten, so each test imports them anew."""
    import sys

    folder = os.path.join(os.path.dirname(__file__), "engines", "reward", "user_modules")
    monkeypatch.syspath_prepend(folder)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p))
    yield folder
    for name in ("my_rewards", "broken_rewards", "planted_rewards"):
        sys.modules.pop(name, None)
