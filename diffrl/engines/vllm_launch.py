"""Runs a vLLM server bound to the process that started it (run by the vLLM venv's interpreter, by path: it imports
nothing of diffrl, whose dependencies that interpreter does not have).

    <vllm python> diffrl/engines/vllm_launch.py PARENT_PID -m vllm.entrypoints.openai.api_server ARGS...

The server runs in its own process group (diffrl/engines/vllm_server.py starts this launcher in a new session), so
stopping it ends the API server, its engine core and its workers together. A `diffrl train` killed with SIGKILL (or
SIGTERM, which runs no atexit hook either) could not stop it, and a vLLM server holds gigabytes of memory (3 GB RSS
for a tiny Qwen3 on the CPU, most of a GPU on a GPU): this launcher watches its parent, and when the parent is gone
(the launcher is re-parented) it stops the whole group: SIGTERM, then SIGKILL once the others have exited or after
STOP_S, whichever comes first. A watching process, not PR_SET_PDEATHSIG: that signal fires when the *thread* that
started the child ends, and diffrl may start the server from a short-lived thread (`diffrl train` builds the engines
while Prefect's server boots: diffrl/flows/commands/train.py).

The launcher exits with the server's exit code, which VllmServer reports when the server dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.25  # how often the parent is checked
STOP_S = 10.0  # how long the group may take to stop on SIGTERM before SIGKILL


def process_group(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group `pgid` (Linux /proc): a server's group once stopped
    is empty. The launcher's own check below, and the tests' check that a stopped server left no process; it lives in
    this script, which runs in vLLM's virtualenv and imports only the standard library."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _others_in_group(group: int, server: subprocess.Popen) -> bool:
    """Whether a live process of `group` other than this launcher is left."""
    server.poll()  # reap the server once it has exited: a zombie child would count as left
    return any(pid != os.getpid() for pid in process_group(group))


def _stop_group(server: subprocess.Popen) -> None:
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    # SIGKILL (this launcher too) as soon as the rest of the group is gone: a fixed sleep of STOP_S would hold a
    # crashed run's restart for 10 s after its server had exited
    deadline = time.monotonic() + STOP_S
    while time.monotonic() < deadline and _others_in_group(group, server):
        time.sleep(POLL_S)
    os.killpg(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent = int(argv[0])
    if os.getppid() != parent:  # the parent died before the launcher started
        return 1
    server = subprocess.Popen([sys.executable, *argv[1:]])
    # VllmServer.stop() signals the whole group: the server shuts down on its own SIGTERM, and the launcher waits for
    # it (set after Popen: an ignored signal would be inherited by the server)
    signal.signal(signal.SIGTERM, lambda *_: None)
    while server.poll() is None:
        if os.getppid() != parent:
            _stop_group(server)
        time.sleep(POLL_S)
    return server.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
