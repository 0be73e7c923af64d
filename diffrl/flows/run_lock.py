"""One writer per run: `diffrl train` holds an exclusive lock on runs/<name>/run.lock for as long as it trains.

Without it two processes training one run name would both run: one dies on an MLflow database race, or both finish
with duplicate MLflow points and two different val/reward values for one step. The lock is an fcntl.flock on the file:
the kernel releases it when its process ends, however it ends (kill -9 included), so a lock left by a dead process
is simply taken by the next one. The file records the holder (pid, host, start time) for the refusal message.
A run whose run.root is an fsspec URI (s3://) is locked in its folder on the driver's disk (ExperimentConfig.local_dir:
runs/<name> under the working directory): two drivers on two machines are not refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from typing import Iterator

LOCK_FILE = "run.lock"
_HELD: set[str] = set()  # the lock files this process holds (flock: two descriptors of one process conflict too)


class RunLocked(ValueError):
    """Another process holds the run's lock (the message names its pid and host)."""


def _say(message: str) -> None:
    print(f"[diffrl] {message}", file=sys.stderr, flush=True)


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}


def _describe(holder: dict) -> str:
    if "pid" not in holder:
        return "another process (it has not recorded its pid yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder['pid']} on host {holder.get('host', '?')} (since {since})"


@contextlib.contextmanager
def run_lock(run_dir: str, run_name: str) -> Iterator[None]:
    """Hold the lock of the run folder `run_dir` for the `with` block; RunLocked if another process holds it."""
    if "://" in run_dir:
        _say(f"{run_dir} is not a local folder: the run is not locked against a second writer")
        yield
        return
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    key = os.path.realpath(path)
    if key in _HELD:  # this process holds it already (`diffrl train` takes it before the flow, which takes it too)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(
                f"run {run_name!r} ({os.path.abspath(run_dir)}) is being trained by {_describe(_holder(fd))}: a second "
                "process would duplicate its MLflow points and race its checkpoints. Wait for it to end or stop it; "
                f"its lock ({path}) goes with its process"
            ) from None
        previous = _holder(fd)
        if previous.get("pid") not in (None, os.getpid()):
            _say(f"taking over the lock {path} left by {_describe(previous)}, which has ended")
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
            os.ftruncate(fd, 0)  # released cleanly: the next run has nothing to take over
    finally:
        os.close(fd)  # releases the flock
