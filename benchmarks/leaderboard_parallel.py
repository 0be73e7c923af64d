"""benchmarks/leaderboard.py's runs several at once on one GPU: `run --parallel K` and `probe`.

One run of the shapes model leaves an H200 about half idle (six shapes_rl runs started together each took ~2.3x
their solo time, so their aggregate throughput was ~2.6x one run's). `run --parallel K` keeps up to K runs going,
each a child process (a fresh interpreter: this script's `run` for one row and seed, told K by `--concurrent`), in
the sequential order, starting the next when one ends. A run's budget is then `budget_s` seconds of training on a
GPU time-sliced between the K runs' contexts: budgets are equal across rows only when every row ran at the same K.

`probe` trains the first row (seed 0) alone and then K copies at once, starting their training together (a
barrier), for `--seconds` of training each, to a temporary folder; it reports each run's training images/s and their
sum per K, so the GPU session picks the K where each run keeps most of its solo speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from benchmarks.common import write_json
from benchmarks.leaderboard_rows import MINIATURE, REPO, ROWS, Plan, Row, finished_run, run_path

# The probe measures training throughput: its runs evaluate one held-out prompt once (before and after), not 204.
PROBE_OVERRIDES = ("data.num_val_prompts=1", "data.val_samples_per_prompt=1")


@dataclass
class Child:
    """A child process training one (row, seed), and where its record and log go."""

    row: Row
    seed: int
    path: str
    log: str
    process: subprocess.Popen
    started: float
    # runs going (itself included) x seconds, since `counted`: a run of the last wave has fewer neighbours
    run_seconds: float = 0.0
    counted: float = 0.0

    def count(self, running: int, now: float) -> None:
        """Add the `running` runs that went since the last count."""
        self.run_seconds += running * (now - (self.counted or self.started))
        self.counted = now

    def mean_alongside(self) -> float:
        """The time-weighted mean of the runs going while this one ran, itself included."""
        return self.run_seconds / max(self.counted - self.started, 1e-9)


def count(running: list[Child]) -> None:
    """Before the running set changes: each running child adds the time since its last count at the set's size."""
    now = time.monotonic()
    for child in running:
        child.count(len(running), now)


@lru_cache
def device_name(plan: Plan) -> str:
    """The device name the runs of `plan` record (run_one's), for the paths of their records and logs."""
    import torch

    from diffrl.configs.schema import load_experiment

    device, _ = load_experiment(plan.config, list(plan.extra)).model.device_and_dtype()
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def start_child(plan: Plan, row: Row, seed: int, out_dir: str, concurrent: int, barrier: str | None = None) -> Child:
    """Start a fresh interpreter training (row, seed) into out_dir; its stdout and stderr go to <record stem>.log."""
    os.makedirs(out_dir, exist_ok=True)
    path = run_path(out_dir, row.name, seed, device_name(plan))
    log = os.path.splitext(path)[0] + ".log"
    with open(log, "w") as f:  # the child holds its own descriptor; ours closes here
        process = subprocess.Popen(
            plan.child_argv(row, seed, out_dir, concurrent, barrier),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return Child(row, seed, path, log, process, time.monotonic())


def finish_child(child: Child) -> dict:
    """The record of an ended child; a failed child's record says finished false with its exit code and log."""
    code = child.process.returncode
    record = {}
    if os.path.exists(child.path):
        with open(child.path) as f:
            record = json.load(f)
    if code != 0 and not record.get("finished"):
        stub = {"algorithm": child.row.name, "seed": child.seed, "history": [], "finished": False}
        record = {**stub, **record, "exit_code": code, "log": os.path.relpath(child.log, os.path.dirname(child.path))}
    if record and child.counted:
        record["mean_runs_alongside"] = child.mean_alongside()
    if record:
        write_json(child.path, record)
    return record


def wait_any(children: list[Child]) -> list[Child]:
    """Block until at least one child has ended; the ended ones."""
    while True:
        ended = [c for c in children if c.process.poll() is not None]
        if ended:
            return ended
        time.sleep(0.2)


def wait_all(children: list[Child]) -> None:
    """Block until every child has ended, or one has failed (the others, waiting at its barrier, are then stopped)."""
    remaining = list(children)
    while remaining:
        for child in wait_any(remaining):
            remaining.remove(child)
            if child.process.returncode != 0:
                stop(remaining)
                return


def stop(children: list[Child]) -> None:
    """End the children this process started that still run (an interrupted parent leaves none behind)."""
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    for child in children:
        try:
            child.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.process.kill()


def run_order(plan: Plan, by_row: bool) -> list[tuple[Row, int]]:
    """(row, seed) in the order runs start: seed by seed in the rows' table order, or (`by_row`) every seed of a row
    before the next, rows in the order `plan.names` gives them."""
    if by_row:
        rows = sorted(plan.rows(), key=lambda r: plan.names.index(r.name))
        return [(row, seed) for row in rows for seed in plan.seeds]
    return [(row, seed) for seed in plan.seeds for row in plan.rows()]


def run_parallel(
    plan: Plan, out_dir: str, parallel: int, deadline_s: float | None, *, by_row: bool = False
) -> list[dict]:
    """The runs of `plan` not finished yet in out_dir, up to `parallel` at once, in the sequential order (seed by
    seed; `by_row`: every seed of a row before the next, rows in the order `plan.names` gives them); no child starts
    that the longest child so far says would end past `deadline_s`. Raises SystemExit (non-zero) after all have
    ended if any failed."""
    pending = []
    for row, seed in run_order(plan, by_row):
        existing = finished_run(out_dir, row.name, seed)
        if existing:
            print(f"{row.name} seed {seed}: finished earlier ({existing}), skipped", flush=True)
        else:
            pending.append((row, seed))
    started, longest_s, running, done, failed = time.monotonic(), None, [], [], []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                row, seed = pending[0]
                if deadline_s and longest_s and time.monotonic() - started + longest_s > deadline_s:
                    print(
                        f"--deadline-s {deadline_s}: {row.name} seed {seed} would end past it; starting no more",
                        flush=True,
                    )
                    pending.clear()
                    break
                pending.pop(0)
                count(running)
                running.append(start_child(plan, row, seed, out_dir, parallel))
                print(f"started {row.name} seed {seed} ({len(running)} running), log {running[-1].log}", flush=True)
            if not running:
                break
            ended = wait_any(running)
            count(running)
            for child in ended:
                running.remove(child)
                seconds = time.monotonic() - child.started
                longest_s = max(longest_s or 0.0, seconds)
                record = finish_child(child)
                code = child.process.returncode
                print(f"ended {child.row.name} seed {child.seed}: exit code {code} after {seconds:.0f} s", flush=True)
                if code != 0:
                    failed.append(f"{child.row.name} seed {child.seed} (exit code {code})")
                else:
                    done.append(record)
    finally:
        stop(running)
    if failed:
        names = ", ".join(failed)
        raise SystemExit(f"{len(failed)} of the runs failed: {names}; their logs are beside their records in {out_dir}")
    return done


def probe(args: argparse.Namespace) -> dict:
    """Train the first row, seed 0, K at once for each K of `--parallel`; training images/s per run and per K."""
    if args.seconds <= 0 or min(args.parallel) < 1:
        raise SystemExit("--seconds must be > 0 and every --parallel K >= 1")
    config, extra = (MINIATURE["config"], [*MINIATURE["overrides"]]) if args.miniature else (args.config, [])
    row = ROWS[0]
    # one evaluation at each end (eval_every_s = the budget), of one prompt: the probe measures training
    plan = Plan(config, (row.name,), (0,), args.seconds, args.seconds, (*extra, *args.overrides, *PROBE_OVERRIDES))
    result = {"row": row.name, "seed": 0, "config": config, "overrides": list(plan.extra), "seconds": args.seconds}
    result["device"], result["by_k"] = device_name(plan), []
    with tempfile.TemporaryDirectory(prefix="leaderboard_probe_") as tmp:
        for k in args.parallel:
            barrier = os.path.join(tmp, f"k{k}_barrier")
            children = [start_child(plan, row, 0, os.path.join(tmp, f"k{k}_run{i}"), k, barrier) for i in range(k)]
            try:
                wait_all(children)
            finally:
                stop(children)
            failed = [c for c in children if c.process.returncode != 0]
            if failed:  # the one that failed first by itself, not a neighbour stopped because of it
                culprit = next((c for c in failed if c.process.returncode > 0), failed[0])
                with open(culprit.log) as f:
                    tail = f.read()[-3000:]
                raise SystemExit(f"probe K={k}: a run failed (exit code {culprit.process.returncode}):\n{tail}")
            runs = []
            for child in children:
                record = finish_child(child)
                last = record["history"][-1]
                runs.append({"train_images_per_s": record["train_images_per_s"], "images": last["images"]})
                runs[-1] |= {"train_s": last["train_s"], "steps": last["step"]}
            per_run = [r["train_images_per_s"] for r in runs]
            entry = {"k": k, "runs": runs, "per_run_mean": sum(per_run) / k, "aggregate_images_per_s": sum(per_run)}
            result["by_k"].append(entry)
            print(
                f"K={k}: {entry['per_run_mean']:.2f} images/s a run, {entry['aggregate_images_per_s']:.2f} in all",
                flush=True,
            )
    solo = next((e["per_run_mean"] for e in result["by_k"] if e["k"] == 1), None)
    for entry in result["by_k"]:
        entry["per_run_vs_solo"] = entry["per_run_mean"] / solo if solo else None
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        write_json(args.out, result)
    return result
