"""Where the host waits for the GPU: the synchronising CUDA calls of RL steps, by stage and call site.

A synchronising call (a device value read back: `.item()`, `float()`, `bool()` of a device tensor, `nonzero`; a copy
between pageable host memory and the device) makes the host wait until every kernel queued before it has run. The GPU
then idles while the host prepares and launches the next kernels. The kernel profile (kernel_profile.py) shows that
idle time, as a busy fraction below 1. This module finds what caused it.

`torch.cuda.set_sync_debug_mode("warn")` makes each such call warn. While `recording` is active, each warning is kept
with its Python stack and the stage that was running. A stage is an entry of the step core's STAGES table, noted
per thread, since the run-ahead worker runs stages beside the main thread. A call is reported at two places:

- `site`: the innermost frame outside torch, the call that asked for the value (it may be in diffusers or peft);
- `diffrl_site`: the innermost frame in diffrl/ or benchmarks/, the line this project can change.

Not seen: synchronisations inside the autograd engine's backward threads, which have no Python frame. Those would
show in the profile, not here.

`summarize` is a pure function of the records, checked on the CPU (tests/benchmarks/test_sync_points.py); the
recording itself needs CUDA.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

from benchmarks import kernel_profile

MESSAGE = "called a synchronizing CUDA operation"  # what torch's sync debug mode warns with
_OURS = (os.sep + "diffrl" + os.sep, os.sep + "benchmarks" + os.sep)
_SKIPPED = (os.sep + "torch" + os.sep, os.sep + "warnings.py", os.sep + "sync_points.py", os.sep + "contextlib.py")


@dataclass(frozen=True)
class SyncRecord:
    """One synchronising call: the stage that ran it and its stack (innermost frame last), as (file, line, function)."""

    stage: str
    frames: tuple[tuple[str, int, str], ...]


def _where(frame: tuple[str, int, str]) -> str:
    """ "path:line (function)", the path from the package on (after site-packages, or from diffrl/ or benchmarks/)."""
    path, line, function = frame
    parts = path.split(os.sep)
    for root, skip in (("site-packages", 1), ("diffrl", 0), ("benchmarks", 0)):
        if root in parts:
            parts = parts[len(parts) - 1 - parts[::-1].index(root) + skip :]
            break
    return f"{'/'.join(parts)}:{line} ({function})"


def _ours(path: str) -> bool:
    return any(s in path for s in _OURS) and "site-packages" not in path and not path.endswith("sync_points.py")


def call_sites(frames: tuple[tuple[str, int, str], ...]) -> tuple[str, str]:
    """(site, diffrl_site) of one record (see the module docstring); "-" where no frame qualifies."""
    site = next((_where(f) for f in reversed(frames) if not any(s in f[0] for s in _SKIPPED)), "-")
    return site, next((_where(f) for f in reversed(frames) if _ours(f[0])), "-")


def summarize(records: list[SyncRecord], steps: int, top: int = 25) -> dict:
    """Synchronising calls per step, in total and by stage, and the `top` call sites (stage, site, diffrl_site) with
    their counts per step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    by_stage = Counter(r.stage for r in records)
    by_site = Counter((r.stage, *call_sites(r.frames)) for r in records)
    return {
        "steps": steps,
        "syncs_per_step": len(records) / steps,
        "by_stage_per_step": {stage: n / steps for stage, n in sorted(by_stage.items())},
        "sites": [
            {"stage": stage, "site": site, "diffrl_site": ours, "per_step": n / steps}
            for (stage, site, ours), n in by_site.most_common(top)
        ],
    }


def format_summary(summary: dict) -> str:
    """A few lines for a terminal: syncs per step by stage, then the call sites."""
    stages = ", ".join(f"{stage} {n:g}" for stage, n in summary["by_stage_per_step"].items())
    lines = [f"synchronising CUDA calls: {summary['syncs_per_step']:g} a step ({stages or 'none'})"]
    for s in summary["sites"]:
        lines.append(f"  {s['per_step']:>6g}  {s['stage']:<13} {s['site']}  <- {s['diffrl_site']}")
    return "\n".join(lines)


@contextlib.contextmanager
def recording(stages: dict[str, tuple[Callable, type]], records: list[SyncRecord]) -> Iterator[None]:
    """While inside, each synchronising CUDA call appends a SyncRecord to `records` (torch's sync debug mode "warn",
    restored on exit; see `capturing`). Needs CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("recording synchronising CUDA calls needs a CUDA device")
    with capturing(stages, records):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def capturing(stages: dict[str, tuple[Callable, type]], records: list[SyncRecord]) -> Iterator[None]:
    """While inside, every warning whose message holds MESSAGE, on any thread, is kept in `records` with its stack and
    the running stage instead of being shown: the STAGES table's entries are wrapped to note the stage per thread. The
    table and the warning filters are restored on exit."""
    local = threading.local()

    def noted(name: str, call: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            outer = getattr(local, "stage", "outside")
            local.stage = name
            try:
                return call(*args, **kwargs)
            finally:
                local.stage = outer

        wrapped.__name__ = getattr(call, "__name__", name)
        return wrapped

    with warnings.catch_warnings(), kernel_profile.wrapped_stages(stages, noted):
        warnings.simplefilter("always")  # every call, not once per line
        shown = warnings.showwarning

        def keep(message, category, filename, lineno, file=None, line=None):
            if MESSAGE not in str(message):
                return shown(message, category, filename, lineno, file, line)
            stack = tuple((f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack()[:-1])
            records.append(SyncRecord(getattr(local, "stage", "outside"), stack))

        warnings.showwarning = keep
        yield
