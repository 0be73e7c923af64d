"""Helpers of the real-vLLM tests."""

from __future__ import annotations

import queue
import subprocess
import threading
import time


def wait_for_line(process: subprocess.Popen, prefix: str, timeout_s: float) -> tuple[str, list[str]]:
    """Read `process`'s stdout until a line starts with `prefix`; (that line, the lines before). AssertionError
    if the process exits or `timeout_s` passes first."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError(f"exited with {process.wait()} before {prefix!r}:\n" + "\n".join(seen[-40:]))
        if line.startswith(prefix):
            return line, seen
        seen.append(line)
    raise AssertionError(f"no {prefix!r} within {timeout_s} s:\n" + "\n".join(seen[-40:]))
