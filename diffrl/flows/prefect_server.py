"""Prefect's temporary server, bound to the process that starts it.

Without PREFECT_API_URL a flow runs on a temporary Prefect server that Prefect starts as a subprocess and stops at
interpreter exit (atexit). A `diffrl train` killed with SIGKILL runs no atexit: its server went on listening (still
after 15 minutes). Here the server process watches its parent: when the parent is gone (the server is re-parented),
it stops itself (SIGTERM to its own uvicorn, then a hard exit). A watcher in the child, not PR_SET_PDEATHSIG: that
signal fires when the *thread* that started the child ends, and diffrl starts the server from a short-lived thread.

    python -m diffrl.flows.prefect_server PARENT_PID UVICORN_ARGS...   (what ParentBoundServer runs)
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

POLL_S = 0.25  # how often the server checks its parent
STOP_S = 5.0  # how long a graceful stop may take before the server exits hard


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: a graceful shutdown
    time.sleep(STOP_S)
    os._exit(0)


def main(argv: list[str]) -> None:
    parent = int(argv[0])
    threading.Thread(target=_watch_parent, args=(parent,), name="parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the watcher started
        os._exit(0)
    from uvicorn.main import main as uvicorn

    uvicorn(args=argv[1:], prog_name="uvicorn")  # exits with uvicorn's code (3: the port is taken)


@functools.cache
def server_class() -> type:
    """A SubprocessASGIServer whose server process ends with this one (created first, it is the instance Prefect's
    client uses: SubprocessASGIServer() returns one instance per port)."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class ParentBoundServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect 3.8.8's command and environment, through this module's watcher
            server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            # no block types registered at boot (2.6 s of a first boot on the GPU machine): diffrl saves no blocks,
            # its result storage is an unsaved one; `prefect server start` registers them when a user starts one
            server_env["PREFECT_API_BLOCKS_REGISTER_ON_START"] = "false"
            return subprocess.Popen(
                args=[
                    sys.executable,
                    "-m",
                    "diffrl.flows.prefect_server",
                    str(os.getpid()),
                    "--app-dir",
                    str(prefect.__module_path__.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env={
                    **os.environ,
                    **server_env,
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
            )

    return ParentBoundServer


if __name__ == "__main__":
    main(sys.argv[1:])
