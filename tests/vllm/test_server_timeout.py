"""A real vLLM server that is not ready within start_timeout_s is stopped, process group and all, and the start
fails with the timeout and the server's log (diffrl/engines/vllm_server.py)."""

from __future__ import annotations

import pytest

from diffrl.configs.vllm import VllmServerOptions
from diffrl.engines.vllm_launch import process_group
from diffrl.engines.vllm_server import VllmServer, VllmServerError
from diffrl.models.tiny import build_tiny

pytestmark = pytest.mark.slow


def test_start_timeout_stops_the_whole_server(tmp_path, vllm_venv_python):
    model = build_tiny("qwen3", str(tmp_path / "qwen3"), seed=0)
    options = VllmServerOptions(dtype="float32", max_model_len=256, start_timeout_s=6, stop_timeout_s=10)
    server = VllmServer(model, options, python=vllm_venv_python, log_path=str(tmp_path / "server.log"))
    with pytest.raises(VllmServerError, match=r"did not answer .*/health within start_timeout_s=6 s \(stopped\)"):
        server.start()
    assert server.process is None and not server.healthy(timeout_s=2)
    assert process_group(server.pid) == []  # API server, engine core and workers: all gone
