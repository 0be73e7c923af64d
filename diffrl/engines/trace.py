"""Where a run's time goes, as a timeline you open in Perfetto (ui.perfetto.dev) or chrome://tracing (`run.trace`).

    with span("update_actor", step=3):   # one bar on this thread's track, named, with its arguments
        ...

Every thread of the process records into one file: the flow's step subflows and stage tasks, the run-ahead
worker's stages, the rollout, reward and writer workers, so a step's critical path and what waited for what can be
read off. The file is Chrome's trace-event JSON array, one event a line, appended and flushed as the run goes (a
crashed run keeps its timeline: the format allows the missing closing bracket). Times are the system's monotonic
clock in microseconds, the same in every process of a machine, so several processes' files can be opened together.

Off unless `enable` was called: `span` is then one global read.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator, TextIO

_lock = threading.Lock()
_out: TextIO | None = None
_named: set[int] = set()  # threads whose name event is written


def enable(path: str) -> None:
    """Record spans into `path` (appended: a resumed run continues its file)."""
    global _out
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with _lock:
        if _out is not None:
            _out.close()
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        _out = open(path, "a")
        if new:
            _out.write("[\n")
        _named.clear()
        _out.write(_event({"name": "process_name", "ph": "M", "args": {"name": f"diffrl pid {os.getpid()}"}}))


def disable() -> None:
    """Stop recording and close the file."""
    global _out
    with _lock:
        if _out is not None:
            _out.close()
        _out = None


def enabled() -> bool:
    return _out is not None


@contextlib.contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """A bar named `name` on the calling thread's track, from entry to exit (an error inside still records it)."""
    if _out is None:
        yield
        return
    started = time.monotonic_ns()
    try:
        yield
    finally:
        _record(name, started, time.monotonic_ns() - started, args)


def _record(name: str, started_ns: int, duration_ns: int, args: dict) -> None:
    tid = threading.get_native_id()
    event = {"name": name, "ph": "X", "ts": started_ns / 1000, "dur": duration_ns / 1000, "tid": tid}
    if args:
        event["args"] = args
    with _lock:
        if _out is None:
            return
        if tid not in _named:
            _named.add(tid)
            thread = {"name": "thread_name", "ph": "M", "tid": tid, "args": {"name": threading.current_thread().name}}
            _out.write(_event(thread))
        _out.write(_event(event))


def flush() -> None:
    """Push what is recorded to the file (after each step: a crash keeps the timeline up to there)."""
    with _lock:
        if _out is not None:
            _out.flush()


def read(path: str) -> list[dict]:
    """The events of a trace file (one JSON event a line, as written here)."""
    with open(path) as f:
        return [json.loads(line.rstrip().rstrip(",")) for line in f if line.startswith("{")]


def _event(event: dict) -> str:
    return json.dumps({**event, "pid": os.getpid()}, separators=(",", ":")) + ",\n"
