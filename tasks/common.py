"""What every stage task shares: its cache key is (run incarnation, step, stage, chunk), so a retried or
resumed flow run finds a completed stage Cached instead of running it again, and results are small
JSON records persisted with the run."""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

from engines import cluster


def stage_cache_key(stage: str) -> Callable[[Any, dict], str]:
    """Prefect cache_key_fn for a stage: same run, step and chunk -> the same key."""
    def key(_context: Any, params: dict) -> str:
        run_name = params["run_name"]
        uid = cluster.get(run_name).extras.get("run_uid", "")
        return f"diffrl-{run_name}-{uid}-step{params['step']}-{stage}-{params.get('chunk', 0)}"
    return key


# Keyword arguments every stage task shares (persisted JSON results -> Cached on retry/resume).
STAGE = dict(persist_result=True, result_serializer="json", retries=0)


def sample_seed(run_seed: int, step: int, global_index: int) -> int:
    """A per-sample generator seed that depends only on (run seed, step, sample position)."""
    digest = hashlib.sha256(f"{run_seed}:{step}:{global_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")  # < 2**56: fits torch.Generator.manual_seed


def inject_fault(stage: str, step: int, chunk: int = 0) -> None:
    """Fault injection for resume/retry tests and drills: DIFFRL_INJECT_FAULT="stage@step[.chunk][:exit]".

    `raise` (default) fails the task with RuntimeError, as an out-of-memory would; `exit` kills the
    process on the spot (os._exit(137), like SIGKILL) to test crash recovery. Unset: does nothing.
    """
    spec = os.environ.get("DIFFRL_INJECT_FAULT", "")
    if not spec:
        return
    where, _, action = spec.partition(":")
    target_stage, _, position = where.partition("@")
    target_step, _, target_chunk = position.partition(".")
    if target_stage != stage or int(target_step or -1) != step or int(target_chunk or 0) != chunk:
        return
    if action == "exit":
        os._exit(137)
    raise RuntimeError(f"injected fault in stage {stage!r} at step {step} chunk {chunk} (DIFFRL_INJECT_FAULT)")
