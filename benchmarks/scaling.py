"""Scaling of `diffrl train` over engine replicas: the same recipe with `cluster.gpus` = 1, 2, ... N
on one machine, one run after another in one call, on one loopback Prefect server and one Ray cluster started here.

Strong scaling: every run trains the recipe's own global batch (the overrides given), split over its replicas. For each
GPU count the result has the run's seconds per step (median of `perf/time_per_step` after --warmup, validation off),
images/s and images/GPU/s, its flow stage medians from MLflow, and per replica (from the stage results the run
persists, diffrl/tasks/stages.py: one per replica and stage) the median seconds of its rollout, update and weight sync
and its peak CUDA memory, which show a straggler or a replica short of memory. `speedup` = images/s at N over images/s
at 1 GPU, `efficiency` = speedup / N; `scaling` is the one figure to compare with a goal: the speedup at 2 GPUs on a
two-GPU machine (goal >= 1.9), the efficiency at the largest N otherwise (goal >= 0.9 at 8).

    python -m benchmarks.scaling --config qwen_image_ocr_lora --gpus 1,2,4,8 --steps 6 --warmup 2 \\
        model.path=random:/tmp/qi "reward.components=[{name: jpeg_compressibility}]" data.num_val_prompts=0
    # writes benchmarks/results/scaling_qwen_image_ocr_lora_h200x8.json on an 8-GPU H200 machine

    python -m benchmarks.scaling --config diffrl/configs/shapes_flow_grpo.yaml --gpus 1,2,4,8 --steps 5 --warmup 2 \\
        model.device=cpu model.path=reference:shapes-small data.num_val_prompts=0 rollout.prompts_per_step=8 \\
        rollout.chunk_size=16 rollout.batch_size=16 train.mini_batch_prompts=8 train.micro_batch_size=16 \\
        --out benchmarks/results/scaling_shapes_small_cpu.json   # CPU: fake GPUs, the placement and exchange are real

(The step's chunks must split evenly over the replicas, and DiffusionNFT, shapes_quick.yaml's algorithm, samples with
the trainer's EMA adapter, which replicas do not support yet: hence FlowGRPO's shapes recipe on the small model.)

On a machine without GPUs the Ray cluster gets max(--gpus) fake GPUs (devices are the CPU; collectives run on gloo): the
replicas share the CPU cores, so images/s there measure what the replicas add (tasks, the exchange, N writers into
one Lance table), not compute scaling.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from benchmarks import common
from benchmarks.replicas_1gpu import start_ray
from benchmarks.train_e2e import run_flow
from diffrl.tasks.common import check_result

HERE = os.path.dirname(os.path.abspath(__file__))

# per replica: the stage record field (or metric) that is its own time in the stage
REPLICA_SECONDS = {
    "generate": "seconds",
    "update_actor": "timing_s/update_actor",
    "sync_weights": "timing_s/sync_weights",
}


def device_name(model_device: str) -> tuple[str, str, int]:
    """(what the runs ran on, its short name for the file: h200x8, h100, cpu; the GPUs there, 0 on a CPU machine)."""
    import torch

    if torch.cuda.is_available() and model_device != "cpu":
        name, count = torch.cuda.get_device_name(), torch.cuda.device_count()
        short = name.split()[1].lower()  # "NVIDIA H200" -> h200
        return f"{count} x {name}", short if count == 1 else f"{short}x{count}", count
    return f"cpu ({os.cpu_count()} cores)", "cpu", 0


def recipe_slug(config: str) -> str:
    """The recipe's name for the result file: qwen_image_ocr_lora for the shipped name or its YAML path."""
    return os.path.splitext(os.path.basename(config))[0]


def replica_records(run_dir: str, run_name: str) -> dict[str, dict[int, list[dict]]]:
    """The persisted stage results of a run's replicated stages: {stage: {step index: [record per file]}}, each record
    the stage's JSON (checked as a run checks it before reading: diffrl/tasks/common.py check_result)."""
    pattern = re.compile(re.escape(f"diffrl-{run_name}-") + r".+-step(\d+)-([a-z_]+)-(\d+)$")
    found: dict[str, dict[int, dict[int, dict]]] = {}
    for path in glob.glob(os.path.join(run_dir, "prefect", f"diffrl-{run_name}-*")):
        match = pattern.match(os.path.basename(path))
        if not match or match.group(2) not in REPLICA_SECONDS:
            continue
        with open(path, "rb") as f:
            record = json.loads(check_result(path, f.read()))["result"]
        step, index = int(match.group(1)), int(match.group(3))  # index: the chunk (generate) or the replica
        found.setdefault(match.group(2), {}).setdefault(step, {})[index] = json.loads(record)
    return {stage: {s: [by[i] for i in sorted(by)] for s, by in steps.items()} for stage, steps in found.items()}


def per_replica(records: dict[str, dict[int, list[dict]]], gpus: int, timed: range) -> dict:
    """Median seconds per replica and stage over the timed steps (a replica's generate: the sum of its chunks), and each
    replica's peak CUDA memory (GiB allocated, from its update's record; absent on CPU)."""
    out: dict = {}
    for stage, field in REPLICA_SECONDS.items():
        by_replica: list[list[float]] = [[] for _ in range(gpus)]
        for step, recs in records.get(stage, {}).items():
            if step + 1 not in timed:  # the records' steps are indices, MLflow's are 1-based
                continue
            if stage == "generate":  # chunk c of a round came from replica c // (chunks per replica)
                chunks = sorted(recs, key=lambda r: r["chunk"])
                share = max(1, len(chunks) // gpus)
                for r in range(gpus):
                    by_replica[r].append(sum(c["seconds"] for c in chunks[r * share : (r + 1) * share]))
            else:  # one record per replica, in replica order (file names end with the replica)
                for r, rec in enumerate(recs[:gpus]):
                    by_replica[r].append(rec["metrics"].get(field, 0.0))
        out[stage] = [_median(v) for v in by_replica]
    peaks = [[] for _ in range(gpus)]
    for recs in records.get("update_actor", {}).values():
        for r, rec in enumerate(recs[:gpus]):
            if "perf/max_memory_allocated_gb" in rec["metrics"]:
                peaks[r].append(rec["metrics"]["perf/max_memory_allocated_gb"])
    out["peak_memory_allocated_gb"] = [max(p) if p else None for p in peaks]
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(header: dict, runs: dict[int, dict], warmup: int, steps: int) -> dict:
    """The result file: per GPU count its medians and replicas, then speedup, efficiency and `scaling`."""
    timed = range(warmup + 1, steps + 1)
    images = header["images_per_step"]
    by_gpus: dict[str, dict] = {}
    for gpus, run in runs.items():
        if "error" in run:
            by_gpus[str(gpus)] = {"error": run["error"]}
            continue
        per_step = run["per_step"]
        medians = {
            k: statistics.median(v) if (v := [s[t] for t in timed if t in s]) else None for k, s in per_step.items()
        }
        seconds = medians["perf/time_per_step"]
        by_gpus[str(gpus)] = {
            "seconds_per_step": seconds,
            "images_per_s": images / seconds if seconds else None,
            "images_per_gpu_s": images / seconds / gpus if seconds else None,
            "stage_medians_s": medians,
            "replicas": run["replicas"],
            "seconds_each": [per_step["perf/time_per_step"].get(s) for s in range(1, steps + 1)],
            "reward_each": [per_step["critic/rewards/mean"].get(s) for s in range(1, steps + 1)],
            "startup_s": run["startup_s"],
        }
    done = {int(g): r for g, r in by_gpus.items() if "error" not in r and r["images_per_s"]}
    speedup = {str(g): r["images_per_s"] / done[1]["images_per_s"] for g, r in done.items()} if 1 in done else {}
    efficiency = {g: s / int(g) for g, s in speedup.items()}
    largest = str(max(done)) if done else None
    two_gpu_machine = header["machine_gpus"] == 2
    scaling = speedup.get("2") if two_gpu_machine else efficiency.get(largest) if largest else None
    return {
        "benchmark": "scaling",
        **header,
        "by_gpus": by_gpus,
        "speedup": speedup,
        "efficiency": efficiency,
        "scaling": scaling,
        "scaling_is": "speedup at 2 GPUs (issue 39)" if two_gpu_machine else f"efficiency at {largest} GPUs (issue 35)",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a shipped config name or a YAML path")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    parser.add_argument("--gpus", default="1,2", help="the GPU counts to run, in this order (comma-separated)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each `diffrl train` run may take")
    parser.add_argument("--keep", default=None, help="keep the runs' folders here (default: a temp dir)")
    parser.add_argument("--out", default=None, help="the JSON result (default: results/scaling_<recipe>_<device>.json)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    counts = [int(g) for g in args.gpus.split(",")]
    if any(g < 1 for g in counts):
        raise SystemExit(f"--gpus takes GPU counts >= 1; got {args.gpus!r}")
    from diffrl.configs.schema import load_experiment
    from diffrl.engines import cluster

    config = os.path.abspath(args.config) if os.path.exists(args.config) else args.config
    overrides = [*args.overrides, f"run.steps={args.steps}", "run.validate_every=0", "cluster.mode=ray"]
    cfg = load_experiment(config, overrides)
    for gpus in counts:  # a batch the replicas cannot share is refused now, not after the runs before it
        load_experiment(config, [*overrides, f"cluster.gpus={gpus}"])
    device, short, machine_gpus = device_name(cfg.model.device)
    if machine_gpus and max(counts) > machine_gpus:
        raise SystemExit(f"--gpus asks for {max(counts)} GPUs; this machine has {machine_gpus}")
    out = args.out or os.path.join(HERE, "results", f"scaling_{recipe_slug(args.config)}_{short}.json")
    workdir = args.keep or tempfile.mkdtemp(prefix="scaling_")
    os.makedirs(f"{workdir}/prefect", exist_ok=True)
    from tests.cluster.servers import start_prefect_server  # the tests' loopback Prefect server

    server, url = start_prefect_server(f"{workdir}/prefect")
    os.environ["PREFECT_API_URL"] = url  # the runs (subprocesses) and the Ray workers report here
    os.environ.setdefault("DIFFRL_CACHE", f"{workdir}/cache")
    header = dict(config=args.config, overrides=args.overrides, device=device, machine_gpus=machine_gpus)
    header.update(gpus=counts, steps=args.steps, warmup=args.warmup, images_per_step=cfg.rollout.samples_per_step)
    header["command"] = " ".join(["python", "-m", "benchmarks.scaling", *(argv if argv is not None else sys.argv[1:])])
    runs: dict[int, dict] = {}
    try:
        # fake GPUs on a CPU machine, and logical CPUs for the N collective tasks (half a Ray CPU each) and the
        # reward actors beside them where the cores are fewer (docs/operations.md)
        cpus = None if machine_gpus else max(os.cpu_count() or 1, max(counts) + 2)
        os.environ["RAY_ADDRESS"] = start_ray(workdir, num_gpus=machine_gpus or max(counts), num_cpus=cpus)
        for gpus in counts:  # each result is written as soon as it is there: a later failure keeps the earlier ones
            folder, name = f"{workdir}/gpus{gpus}", f"scaling-gpus{gpus}"
            os.makedirs(folder, exist_ok=True)
            extra = [f"cluster.gpus={gpus}", f"run.root={folder}/runs", f"run.name={name}"]
            print(f"[scaling] {gpus} GPU(s): diffrl train, {args.steps} steps", file=sys.stderr, flush=True)
            try:
                runs[gpus] = run_flow(config, [*overrides, *extra], folder, args.timeout)
                records = replica_records(f"{folder}/runs/{name}", name)
                runs[gpus]["replicas"] = per_replica(records, gpus, range(args.warmup + 1, args.steps + 1))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                runs[gpus] = {"error": str(e)[-3000:]}
            cluster.stop_actors(name)  # the next run gets the GPUs to itself
            common.write_json(out, summary(header, runs, args.warmup, args.steps))
            print(f"[scaling] {gpus} GPU(s): {'failed' if 'error' in runs[gpus] else 'done'}", file=sys.stderr)
    finally:
        import ray

        ray.shutdown()
        server.terminate()
        server.wait(timeout=30)
    result = summary(header, runs, args.warmup, args.steps)
    print(json.dumps({k: result[k] for k in ("device", "speedup", "efficiency", "scaling", "scaling_is")}, indent=1))
    return result


if __name__ == "__main__":
    main()
