"""Start a Prefect server on loopback for tests (its own PREFECT_HOME; the caller stops the process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

VENV_BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefect_server(home: str) -> tuple[subprocess.Popen, str]:
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME; returns (process, API URL) once healthy."""
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": home,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(os.path.join(home, "server.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited: {open(log.name).read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("prefect server did not become healthy within 90 s")
