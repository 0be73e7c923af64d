"""diffrl warns when it joins a Ray cluster that answers beyond loopback without authentication:
a real `ray start --head`, joined by diffrl's own connect in a fresh process, without and with token
authentication (the set-up docs/operations.md section 5 shows)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from servers import VENV_BIN, free_port

from diffrl.engines.ray_exposure import answers, local_addresses


def _head_and_join(env: dict) -> str:
    """Start a head node with `env`, join it with diffrl.engines.cluster.connect; the joining process's stderr."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    head = subprocess.Popen(
        [os.path.join(VENV_BIN, "ray"), "start", "--head", "--block", "--port", str(port), "--num-cpus", "1"]
        + ["--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: stopped as a whole below, no other Ray touched
    )
    try:
        deadline = time.time() + 90
        while not answers("127.0.0.1", port) and time.time() < deadline:
            time.sleep(0.5)
        joined = subprocess.run(
            [sys.executable, "-c", f"from diffrl.engines.cluster import connect; connect('127.0.0.1:{port}')"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert joined.returncode == 0, joined.stderr[-2000:]
        return joined.stderr.replace(f":{port} ", ":PORT ")
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # SIGTERM: Ray's orderly shutdown took 33 s here
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # 11 s alone, 28 s beside the session's Ray cluster on 2 cores
def test_joining_a_cluster_open_to_the_network_warns_unless_it_has_a_token(tmp_path):
    pytest.importorskip("ray")
    if not local_addresses():
        pytest.skip("this machine has no address but loopback: nothing to warn about")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # `ray start` without a token file: no authentication (Ray 2.60 warns on its own console only)
    open_cluster = _head_and_join({**env, "RAY_AUTH_MODE": "disabled"})
    assert ":PORT is reachable beyond loopback" in open_cluster, open_cluster  # Ray names it by the node's IP
    assert "runs without authentication" in open_cluster and "RAY_AUTH_MODE=token" in open_cluster
    # the same with token authentication, both sides reading one token file: no warning
    token = tmp_path / "auth_token"
    token.write_text("0123456789abcdef0123456789abcdef")
    guarded = _head_and_join({**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    assert "reachable beyond loopback" not in guarded, guarded
