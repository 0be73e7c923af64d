"""A long `diffrl train` as a user runs it, watched from outside: the process's memory, the Prefect database and the
run folder step by step, and the disk estimate the run prints against what it wrote.

The run gets a scratch working directory and its own PREFECT_HOME (so the temporary Prefect server's database is this
run's alone). Every `--every` seconds the watcher records the step the console reached, the resident memory of the
`diffrl train` process and of its Prefect server, the size of PREFECT_HOME's database and of the run folder. Growth
per step is the least-squares slope over the steps after `--warmup`.

    python -m benchmarks.long_run --steps 500 --out benchmarks/results/long_run_cpu.json
    python -m benchmarks.long_run --config diffrl/configs/shapes_flow_grpo.yaml --steps 500 model.device=cuda
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import psutil

STEP = re.compile(r"step (\d+)/(\d+)")
DISK = re.compile(r"disk: about ([\d.]+) (GB|MB|KB).*up to ([\d.]+) (GB|MB|KB)")
UNIT = {"GB": 1e9, "MB": 1e6, "KB": 1e3}


def folder_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except FileNotFoundError:  # removed by retention while counted
                pass
    return total


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x (None for fewer than 2 distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def rss_mb(process: psutil.Process) -> tuple[float, float]:
    """(the process's resident MB, its children's together: the Prefect server and any worker)."""
    own = process.memory_info().rss / 1e6
    children = 0.0
    for child in process.children(recursive=True):
        try:
            children += child.memory_info().rss / 1e6
        except psutil.NoSuchProcess:
            pass
    return own, children


def watch(args: argparse.Namespace, workdir: str) -> dict:
    home = os.path.join(workdir, "prefect-home")
    env = {**os.environ, "PREFECT_HOME": home, "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # its own temporary server, its own database
    command = [sys.executable, "-m", "diffrl.flows.cli", "train"]
    command += [*([args.config] if args.config else []), f"run.steps={args.steps}", "run.name=long", *args.overrides]
    started = time.time()
    proc = subprocess.Popen(command, cwd=workdir, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    state = {"step": 0, "estimate": None, "estimate_peak": None, "lines": []}

    def read() -> None:
        for line in proc.stderr:
            state["lines"] = (state["lines"] + [line.rstrip()])[-40:]
            if found := STEP.search(line):
                state["step"] = int(found.group(1))
            if (found := DISK.search(line)) and state["estimate"] is None:
                state["estimate"] = float(found.group(1)) * UNIT[found.group(2)]
                state["estimate_peak"] = float(found.group(3)) * UNIT[found.group(4)]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples, peak_run = [], 0
    process = psutil.Process(proc.pid)
    run_dir = os.path.join(workdir, "runs", "long")
    while proc.poll() is None:
        time.sleep(args.every)
        try:
            own, children = rss_mb(process)
        except psutil.NoSuchProcess:
            break
        db = os.path.join(home, "prefect.db")
        run_bytes = folder_bytes(run_dir)
        peak_run = max(peak_run, run_bytes)
        samples.append(
            dict(
                t=round(time.time() - started, 1),
                step=state["step"],
                rss_mb=round(own, 1),
                children_rss_mb=round(children, 1),
                prefect_db_bytes=os.path.getsize(db) if os.path.exists(db) else 0,
                run_bytes=run_bytes,
            )
        )
    reader.join(timeout=30)
    final = folder_bytes(run_dir)
    return dict(
        returncode=proc.wait(),
        seconds=round(time.time() - started, 1),
        samples=samples,
        estimate_bytes=state["estimate"],
        estimate_peak_bytes=state["estimate_peak"],
        run_bytes_final=final,
        run_bytes_peak=max(peak_run, final),
        tail=state["lines"][-5:],
    )


def summary(run: dict, warmup: int) -> dict:
    timed = [s for s in run["samples"] if s["step"] > warmup and s["rss_mb"] > 0]

    def per_step(key: str, scale: float) -> float | None:
        fitted = slope([(s["step"], s[key] / scale) for s in timed])
        return None if fitted is None else round(fitted, 4)

    estimate, final = run["estimate_bytes"], run["run_bytes_final"]
    estimate_peak, peak = run["estimate_peak_bytes"], run["run_bytes_peak"]
    return {
        "rss_mb_per_step": per_step("rss_mb", 1.0),
        "children_rss_mb_per_step": per_step("children_rss_mb", 1.0),
        "prefect_db_kb_per_step": per_step("prefect_db_bytes", 1e3),
        "rss_mb_first_last": [timed[0]["rss_mb"], timed[-1]["rss_mb"]] if timed else None,
        "disk_estimate_over_final": round(estimate / final, 3) if estimate and final else None,
        "disk_peak_estimate_over_peak": round(estimate_peak / peak, 3) if estimate_peak and peak else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a config (default: the quickstart's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the growth slopes")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="long_run_")
    run = watch(args, workdir)
    result = {
        "benchmark": "long_run",
        "command": " ".join(["python", "-m", "benchmarks.long_run", *(argv if argv is not None else sys.argv[1:])]),
        "device": f"cpu ({os.cpu_count()} cores)" if "model.device=cuda" not in args.overrides else "cuda",
        "steps": args.steps,
        **summary(run, args.warmup),
        **run,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    return result


if __name__ == "__main__":
    main()
