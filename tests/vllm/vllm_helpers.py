"""Helpers of the real-vLLM tests."""

from __future__ import annotations

import queue
import subprocess
import threading
import time

from diffrl.configs.vllm import VllmRolloutOptions


def cpu_options(**overrides) -> VllmRolloutOptions:
    """The rollout server of the CPU tests: fp32 (log-probs that match the fp32 trainer), a short context, prefills of
    16 sequences never split (vLLM 0.24 on a CPU fails a seeded request whose prefill is split), generous timeouts."""
    settings = dict(
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        start_timeout_s=300,
        request_timeout_s=60,
    )
    return VllmRolloutOptions(**{**settings, **overrides})


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
