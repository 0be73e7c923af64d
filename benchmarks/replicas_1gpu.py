"""No loss at one replica: `diffrl train` in one process against `cluster.mode=ray cluster.gpus=1` (one engine replica
in a Ray actor), in one call, same config, seeds and steps.

The runs of the same command line, each in its own scratch folder, alternate A-B-A-B (`--repeat` rounds) on one
Prefect server on loopback (started here, for all: the local run does not pay for a temporary server the Ray runs
don't) and, for the Ray runs, one Ray cluster started in this process (its GPUs, or one fake GPU on a CPU machine):

    colocated      `diffrl train CONFIG`                                       (cluster.mode local: one process)
    gpus1          `diffrl train CONFIG cluster.mode=ray cluster.gpus=1`       (the replica path at N = 1)

Seconds per step are each run's own `perf/time_per_step` (end of a step to the end of the next, validation left out)
from MLflow, medians over the steps after --warmup, then the median over a mode's rounds (`spread`: the rounds' lowest
and highest). `gpus1_over_colocated` = gpus1 / colocated; `gpus1_replicas` lists the actors each gpus1 run held (read
from the Ray cluster before they are stopped): the run went through the replica actor.

    python -m benchmarks.replicas_1gpu --steps 30 --warmup 3     # GPU: benchmarks/results/replicas_1gpu_<device>.json
    python -m benchmarks.replicas_1gpu --config diffrl/configs/shapes_quick.yaml --steps 6 --warmup 2 \\
        model.device=cpu data.num_val_prompts=0 --out benchmarks/results/replicas_1gpu_cpu.json     # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import common
from benchmarks.train_e2e import run_flow

HERE = os.path.dirname(os.path.abspath(__file__))

MODES = {
    "colocated": [],
    "gpus1": ["cluster.mode=ray", "cluster.gpus=1"],
}


def device_name(model_device: str) -> tuple[str, str]:
    """(what the runs ran on, its short name for the file: h100, h200, cpu)."""
    import torch

    if torch.cuda.is_available() and model_device != "cpu":
        name = torch.cuda.get_device_name()
        return name, name.split()[1].lower()  # "NVIDIA H100 80GB HBM3" -> h100, as benchmarks/train_e2e_gpu.sh names it
    return f"cpu ({os.cpu_count()} cores)", "cpu"


def start_ray(workdir: str, num_gpus: int | None = None, num_cpus: int | None = None) -> str:
    """A Ray cluster owned by this process, its address: the machine's GPUs (one fake GPU without any) unless
    `num_gpus` says how many (fake ones on a CPU machine), the machine's CPUs unless `num_cpus` says."""
    import ray
    import torch

    gpus = num_gpus or torch.cuda.device_count() or 1
    ctx = ray.init(
        num_gpus=gpus,
        num_cpus=num_cpus,
        namespace="diffrl",
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=f"{workdir}/ray",
    )
    return ctx.address_info["gcs_address"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="diffrl/configs/shapes_flow_grpo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each `diffrl train` run may take")
    parser.add_argument("--keep", default=None, help="keep the runs' folders here (default: a temp dir)")
    parser.add_argument("--out", default=None, help="the JSON result (default: results/replicas_1gpu_<device>.json)")
    parser.add_argument("--modes", default=",".join(MODES), help="which of the runs, in this order (comma-separated)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the modes, alternated (A-B-A-B)")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    modes = args.modes.split(",")
    order = [(mode, r) for r in range(args.repeat) for mode in modes]
    from diffrl.configs.schema import load_experiment
    from diffrl.engines import cluster

    config = os.path.abspath(args.config) if os.path.exists(args.config) else args.config
    overrides = [*args.overrides, f"run.steps={args.steps}", "run.validate_every=0"]
    cfg = load_experiment(config, overrides)
    device, short = device_name(cfg.model.device)
    out = args.out or os.path.join(HERE, "results", f"replicas_1gpu_{short}.json")
    workdir = args.keep or tempfile.mkdtemp(prefix="replicas_1gpu_")
    os.makedirs(f"{workdir}/prefect", exist_ok=True)
    from tests.cluster.servers import start_prefect_server  # the tests' loopback Prefect server

    server, url = start_prefect_server(f"{workdir}/prefect")
    os.environ["PREFECT_API_URL"] = url  # the runs (subprocesses) and the Ray workers report here
    os.environ.setdefault("DIFFRL_CACHE", f"{workdir}/cache")
    runs: dict[str, dict] = {}
    header = dict(config=args.config, overrides=args.overrides, device=device, steps=args.steps, warmup=args.warmup)
    header.update(images_per_step=cfg.rollout.samples_per_step, order=[f"{m}#{r}" for m, r in order])
    header["command"] = " ".join(
        ["python", "-m", "benchmarks.replicas_1gpu", *(argv if argv is not None else sys.argv[1:])]
    )
    try:
        os.environ["RAY_ADDRESS"] = start_ray(workdir)
        for mode, round_ in order:  # each result is written as soon as it is there: a failure keeps the earlier ones
            label = f"{mode}#{round_}"
            folder, name = f"{workdir}/{mode}-{round_}", f"replicas-1gpu-{mode}-{round_}"
            os.makedirs(folder, exist_ok=True)
            extra = [*MODES[mode], f"run.root={folder}/runs", f"run.name={name}"]
            try:
                runs[label] = run_flow(config, [*overrides, *extra], folder, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                runs[label] = {"error": str(e)[-3000:]}
            if MODES[mode]:  # what held the run: the replica actor (not the in-process path)
                keys = ("name", "holds", "builds", "policy_version")
                runs[label]["actors"] = [{k: a.get(k) for k in keys} for a in cluster.list_actors(name)]
            cluster.stop_actors(name)  # the next run gets the GPU to itself
            common.write_json(out, summary(header, runs, args.warmup, args.steps))
            print(f"{label}: {'failed' if 'error' in runs[label] else 'done'}", file=sys.stderr, flush=True)
    finally:
        import ray

        ray.shutdown()
        server.terminate()
        server.wait(timeout=30)
    result = summary(header, runs, args.warmup, args.steps)
    print(json.dumps({k: v for k, v in result.items() if k not in ("seconds_each", "reward_each")}, indent=1))
    return result


def summary(header: dict, runs: dict[str, dict], warmup: int, steps: int) -> dict:
    """The result file: per run (`mode#round`) the medians over the steps after `warmup`; per mode the median and the
    spread of its rounds; the ratio; each step's seconds and reward."""
    timed = range(warmup + 1, steps + 1)  # MLflow steps are 1-based
    done = {label: run["per_step"] for label, run in runs.items() if "error" not in run}

    def median(label: str, key: str) -> float | None:
        values = [done[label][key][s] for s in timed if s in done[label][key]]
        return statistics.median(values) if values else None

    per_run = {label: median(label, "perf/time_per_step") for label in done}
    modes = sorted({label.split("#")[0] for label in done})
    rounds = {m: [v for label, v in per_run.items() if label.split("#")[0] == m and v is not None] for m in modes}
    seconds = {m: statistics.median(v) for m, v in rounds.items() if v}
    ratio = seconds["gpus1"] / seconds["colocated"] if seconds.get("gpus1") and seconds.get("colocated") else None
    return {
        "benchmark": "replicas_1gpu",
        **header,
        "seconds_per_step": seconds,
        "spread": {m: [min(v), max(v)] for m, v in rounds.items() if v},
        "seconds_per_step_each_round": per_run,
        "gpus1_over_colocated": ratio,
        "gpus1_replicas": {label: run.get("actors") for label, run in runs.items() if label.startswith("gpus1")},
        "stage_medians_s": {label: {k: median(label, k) for k in per_step} for label, per_step in done.items()},
        "seconds_each": {m: [p["perf/time_per_step"].get(s) for s in range(1, steps + 1)] for m, p in done.items()},
        "reward_each": {m: [p["critic/rewards/mean"].get(s) for s in range(1, steps + 1)] for m, p in done.items()},
        "errors": {label: run["error"] for label, run in runs.items() if "error" in run},
    }


if __name__ == "__main__":
    main()
