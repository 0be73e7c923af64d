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


# Tests that share one process-wide resource run on one pytest-xdist worker (`make test` runs two, `--dist
# loadgroup`): the Ray cluster tests (one local cluster, its fake GPUs and named actors) and the vLLM tests (one
# cached venv, CPU-heavy servers). Without xdist the marks do nothing.
XDIST_GROUPS = {"cluster": "ray", "vllm": "vllm"}


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    tests = os.path.dirname(__file__)
    for item in items:
        folder = os.path.relpath(str(item.path), tests).split(os.sep)[0]
        if folder in XDIST_GROUPS:
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUPS[folder]))


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
