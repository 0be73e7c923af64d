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
