"""Fixtures for whole-flow tests: a tiny, fast experiment in a temporary working directory."""

from __future__ import annotations

import os

import pytest
from e2e_settings import TINY  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="session")
def diffrl_cache(tmp_path_factory):
    """One tiny-model cache for the whole session (DIFFRL_CACHE), shared with subprocesses."""
    path = str(tmp_path_factory.mktemp("diffrl_cache"))
    os.environ["DIFFRL_CACHE"] = path
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch, diffrl_cache):
    """A fresh working directory: runs/ and mlflow.db land here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DIFFRL_INJECT_FAULT", raising=False)
    return tmp_path
