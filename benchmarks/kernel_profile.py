"""Where a profiled RL step's GPU time goes: device kernels by kind, per stage, and how busy the GPU was.

`torch.profiler` lists every kernel with its device time; its own tables mix CPU operators (whose "device time" is
their kernels') with the kernels themselves, so shares do not add up. This module reads the kernels alone:

- kind: attention (SDPA / flash / cuDNN fused attention), matmul (cuBLAS / nvjet / CUTLASS GEMMs), fused (inductor's
  generated Triton kernels: norms, modulation, activations, the SDE math), convolution (the VAE), copy (memcpy /
  memset), other (eager elementwise and reduction kernels, optimizer);
- stage: the RL-step stage (generate, score, advantages, update_actor, sync_weights) whose range held the CPU call
  that launched the kernel (the stages are wrapped in `record_function("stage:<name>")` ranges while profiling);
- busy: the union of the kernels' device intervals over the step's wall time (1 - busy = the GPU waiting on the CPU,
  on launches or on host work such as the reward and the log-prob bookkeeping).

The summary is a pure function of (name, start, end, launch time, launch thread) tuples, so it is checked on the CPU
against hand-counted intervals (tests/benchmarks/test_kernel_profile.py); `profile_rows` reads them from a profiler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

KINDS = ("matmul", "attention", "fused", "convolution", "copy", "other")
STAGE_PREFIX = "stage:"
WINDOW = "profiled_step"  # the record_function range around the one step profiled
_ATTENTION = ("sdpa", "flash", "fmha", "attention", "attn")
_CONVOLUTION = ("conv", "implicit", "fprop", "dgrad", "wgrad", "winograd")
_MATMUL = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "splitk")


def kernel_kind(name: str) -> str:
    """The kind of a device kernel from its name (see the module docstring); attention is checked first, as cuDNN's
    fused attention kernels carry GEMM-like tile and "fprop" names."""
    low = name.lower()
    if low.startswith(("memcpy", "memset")):
        return "copy"
    if any(key in low for key in _ATTENTION):
        return "attention"
    if low.startswith("triton"):
        return "fused"
    if any(key in low for key in _CONVOLUTION):  # before matmul: cuDNN runs convolutions as implicit GEMMs
        return "convolution"
    if any(key in low for key in _MATMUL):
        return "matmul"
    return "other"


@dataclass(frozen=True)
class Kernel:
    """One device kernel: its device interval and the CPU call that launched it (microseconds, one clock)."""

    name: str
    start_us: float
    end_us: float
    launch_us: float
    launch_thread: int


@dataclass(frozen=True)
class StageRange:
    """A stage's CPU range on the thread that ran it."""

    stage: str
    start_us: float
    end_us: float
    thread: int


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def stage_of(kernel: Kernel, ranges: list[StageRange]) -> str:
    """The stage whose range holds the kernel's launch: one on the launching thread first, else the shortest range
    holding it on any thread (a stage's helper threads, e.g. the VAE decode's), else "outside"."""
    holding = [r for r in ranges if r.start_us <= kernel.launch_us <= r.end_us]
    if not holding:
        return "outside"
    own = [r for r in holding if r.thread == kernel.launch_thread]
    return min(own or holding, key=lambda r: r.end_us - r.start_us).stage


def summarize(kernels: list[Kernel], ranges: list[StageRange], window: tuple[float, float], top: int = 15) -> dict:
    """Device seconds by kind, by stage (and kind within it), the GPU's busy fraction over the step, the top kernels.

    Only kernels launched inside `window` (the profiled step's CPU range, start and end in microseconds) count: the
    run-ahead worker starts the next step's rollout during this step's weight sync, and its kernels launched after the
    step returned belong to the next step. Per stage, `wall_s` is the sum of its CPU ranges (clipped to the window) and
    `busy` its kernels' union over that (a stage's kernels run inside its range when the stage ends with a
    synchronisation, as each RL-step stage does)."""
    lo, hi = window
    wall_us = hi - lo
    kernels = [k for k in kernels if lo <= k.launch_us <= hi]
    ranges = [
        StageRange(r.stage, max(r.start_us, lo), min(r.end_us, hi), r.thread)
        for r in ranges
        if r.end_us > lo and r.start_us < hi
    ]
    by_kind = dict.fromkeys(KINDS, 0.0)

    def entry_of(stage: str) -> dict:
        return stages.setdefault(stage, {"kernel_s": dict.fromkeys(KINDS, 0.0), "intervals": []})

    stages: dict[str, dict] = {}
    for r in ranges:  # every stage that ran is listed, with or without kernels
        entry_of(r.stage)
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        seconds, kind = (k.end_us - k.start_us) / 1e6, kernel_kind(k.name)
        by_kind[kind] += seconds
        entry = entry_of(stage_of(k, ranges))
        entry["kernel_s"][kind] += seconds
        entry["intervals"].append((k.start_us, k.end_us))
        by_name.setdefault(k.name, [0, 0.0])
        by_name[k.name][0] += 1
        by_name[k.name][1] += seconds
    total = sum(by_kind.values())
    out_stages = {}
    for stage, entry in sorted(stages.items()):
        wall = sum(r.end_us - r.start_us for r in ranges if r.stage == stage) / 1e6
        busy = union_us(entry["intervals"]) / 1e6
        out_stages[stage] = {
            "wall_s": wall if stage != "outside" else None,
            "busy_s": busy,
            "busy_fraction": busy / wall if wall > 0 and stage != "outside" else None,
            "kernel_s": entry["kernel_s"],
        }
    ranked = sorted(by_name.items(), key=lambda item: item[1][1], reverse=True)[:top]
    busy = union_us((k.start_us, k.end_us) for k in kernels) / 1e6
    return {
        "wall_s": wall_us / 1e6,
        "kernel_s": total,
        "busy_s": busy,
        "busy_fraction": busy / (wall_us / 1e6) if wall_us > 0 else None,
        "kernel_s_by_kind": by_kind,
        "share_by_kind": {kind: (s / total if total else 0.0) for kind, s in by_kind.items()},
        "stages": out_stages,
        "top_kernels": [
            {"name": name[:120], "kind": kernel_kind(name), "calls": calls, "seconds": s, "share": s / total}
            for name, (calls, s) in ranked
        ],
    }


def format_summary(summary: dict) -> str:
    """A few lines for a terminal: the busy fraction, the kinds' shares, and each stage's seconds by kind."""
    share = ", ".join(f"{kind} {summary['share_by_kind'][kind]:.0%}" for kind in KINDS)
    lines = [
        f"profiled step: {summary['wall_s']:.2f} s, GPU busy {summary['busy_s']:.2f} s "
        f"({(summary['busy_fraction'] or 0):.0%}); kernel time by kind: {share}"
    ]
    for stage, entry in summary["stages"].items():
        kinds = ", ".join(f"{kind} {s:.2f}" for kind, s in entry["kernel_s"].items() if s >= 0.005)
        wall = "-" if entry["wall_s"] is None else f"{entry['wall_s']:.2f} s"
        lines.append(f"  {stage:<14} wall {wall:>8}, busy {entry['busy_s']:.2f} s: {kinds}")
    return "\n".join(lines)


def profile_rows(prof) -> tuple[list[Kernel], list[StageRange], tuple[float, float]]:
    """Kernels (with their launching CPU call), stage ranges and the `WINDOW` range's (start, end) from a finished
    `torch.profiler.profile`."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    cpu_by_id = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    kernels, ranges, window = [], [], None
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name == WINDOW:
                window = (e.time_range.start, e.time_range.end)
            elif e.name.startswith(STAGE_PREFIX):
                ranges.append(StageRange(e.name[len(STAGE_PREFIX) :], e.time_range.start, e.time_range.end, e.thread))
            continue
        if getattr(e, "is_user_annotation", False) or e.name.startswith(STAGE_PREFIX) or e.name == WINDOW:
            continue  # the GPU-side copy of a record_function range, not a kernel
        launch = cpu_by_id.get(getattr(e, "linked_correlation_id", 0))
        kernels.append(
            Kernel(
                e.name,
                e.time_range.start,
                e.time_range.end,
                launch.time_range.start if launch is not None else e.time_range.start,
                launch.thread if launch is not None else -1,
            )
        )
    if window is None:
        raise ValueError(f"no {WINDOW!r} range in the profile: wrap the profiled step in record_function({WINDOW!r})")
    return kernels, ranges, window


@contextlib.contextmanager
def wrapped_stages(
    stages: dict[str, tuple[Callable, type]], wrap: Callable[[str, Callable], Callable]
) -> Iterator[None]:
    """While inside, each entry of the step core's STAGES table runs as `wrap(name, call)`; the table is restored on
    exit."""
    saved = dict(stages)
    for name, (call, kind) in saved.items():
        stages[name] = (wrap(name, call), kind)
    try:
        yield
    finally:
        stages.update(saved)


def stage_ranges(stages: dict[str, tuple[Callable, type]]):
    """While inside, each stage runs in a `record_function("stage:<name>")` range; the profiler then tells which stage
    launched each kernel."""
    from torch.profiler import record_function

    def ranged(name: str, call: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            with record_function(STAGE_PREFIX + name):
                return call(*args, **kwargs)

        wrapped.__name__ = getattr(call, "__name__", name)
        return wrapped

    return wrapped_stages(stages, ranged)
