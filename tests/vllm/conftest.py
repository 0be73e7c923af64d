"""Fixtures of the real-vLLM tests: the vLLM virtualenv, created by the first test that needs it and then reused from
~/.cache/diffrl/vllm (a cold CI machine spends a few minutes here once, docs/operations.md)."""

from __future__ import annotations

import os
import sys

import pytest

from diffrl.engines.vllm_env import vllm_python

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))


@pytest.fixture(scope="session")
def vllm_venv_python() -> str:
    """The interpreter of diffrl's vLLM venv (DIFFRL_VLLM_PYTHON, else the cached venv, created when missing)."""
    return vllm_python()
