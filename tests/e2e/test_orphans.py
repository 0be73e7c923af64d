"""No orphans: `diffrl train` killed with SIGKILL takes its temporary Prefect server with it (a server left behind
would go on listening)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from e2e_settings import TINY


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _server(pid: int) -> tuple[int, int] | None:
    """(pid, port) of the Prefect server process started by `pid`, once there is one."""
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline") as f:
                args = f.read().split("\0")
        except OSError:
            continue
        if "diffrl.flows.prefect_server:create_app" in args:  # Prefect's app behind RetryWhenBusy
            return child, int(args[args.index("--port") + 1])
    return None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_killed_diffrl_train_takes_its_prefect_server_with_it(workdir):
    with open(workdir / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffrl.flows.cli", "train", *TINY, "run.steps=100"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            # the temporary server, even where the test session has a Prefect server (tests/cluster's fixture)
            env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
            start_new_session=True,  # so the test can clean up the whole group whatever happens
        )
    try:
        assert _wait(lambda: _server(proc.pid) is not None, 60), (workdir / "stderr.txt").read_text()[-2000:]
        server, port = _server(proc.pid)
        assert _wait(lambda: _listening(port), 60)
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no finally: only the server's own watch can stop it
        proc.wait()
        assert _wait(lambda: not _listening(port) and not _alive(server), 10), "the Prefect server outlived diffrl"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
