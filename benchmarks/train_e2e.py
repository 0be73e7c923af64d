"""`diffrl train` as users run it, against the engines-only loop on the same config, in one call.

1. The product: `python -m flows.cli train CONFIG run.steps=N ...` in a subprocess (Prefect flow with one subflow
   per step, Lance tables, MLflow, checkpoints), in a scratch working directory. Its seconds per step are the
   flow's own `perf/time_per_step` (end of one step to the end of the next, validation left out), read back from
   MLflow; startup is `startup_s/*` (the command to the first step, by part); bytes are what the run folder holds
   at the end, per step.
2. The engines: the same config's engines built in this process without a store (flows.build.build_engines
   durable=False), stepped through the same step core (diffrl/engines/step/run.py run_step, stages called directly):
   no Prefect, no Lance, no MLflow, no checkpoints. Same seeds and prompts.

flow_over_engine = median seconds per step of 1 / median of 2, over the steps after --warmup (of every pair, with
--repeats N: flow, engines, flow, engines, ...).

    python -m benchmarks.train_e2e --config diffrl/configs/shapes_flow_grpo.yaml --steps 30 \\
        --out benchmarks/results/train_e2e_shapes_h200.json
    python -m benchmarks.train_e2e --config diffrl/configs/shapes_quick.yaml --steps 4 --warmup 1 model.device=cpu \\
        --out /tmp/e2e.json     # CPU smoke run

A model too large for both runs in one 10-minute device call (Qwen-Image at real size) runs them in two calls with the
same config and overrides: `--flow-only --keep DIR`, then `--flow-from DIR --out x.json`. `--engines-only --out x.json`
runs the engines alone (the step core without Prefect, Lance, MLflow or checkpoints: Wan2.2 A14B at real size, whose
steps take minutes).

A video run (rollout.num_frames > 1) also records videos_per_gpu_s and frames_per_gpu_s (one GPU: videos a step x
frames a video / seconds a step). With --trace the engines' result sums the timeline's bars by name
(`engine_trace_s`: generate, denoise, decode, update_actor, ... per step), the rollout's denoising apart from its
VAE decode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

from benchmarks import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per-step metrics both runs record (medians in the result).
STAGE_KEYS = (
    "perf/time_per_step",
    "timing_s/step",
    "timing_s/generate",
    "timing_s/generate_wait",
    "timing_s/reward",
    "timing_s/reward_wait",
    "timing_s/update_actor",
    "timing_s/checkpoint",
    "timing_s/writer_wait",
    "timing_s/sync_weights",
    "timing_s/unaccounted",
    "critic/rewards/mean",
    "rollout_corr/logprob_abs_diff_mean",
    "rollout_corr/logprob_abs_diff_max",
    "perf/throughput",
    "perf/max_memory_allocated_gb",
    "perf/max_memory_reserved_gb",
    "response_length/mean",
)


def run_flow(config: str, overrides: list[str], workdir: str, timeout_s: float) -> dict:
    """`diffrl train` in a subprocess in `workdir`; its per-step and startup metrics from MLflow, and its bytes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("MLFLOW_TRACKING_URI", None)
    log_path = os.path.join(workdir, "train.log")
    started = time.time()  # its startup report counts from the command's start, a few tens of ms after this
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "diffrl.flows.cli", "train", config, *overrides],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout_s,
        )
    wall = time.time() - started
    with open(os.path.join(workdir, "flow_wall_seconds"), "w") as f:
        f.write(str(wall))
    with open(log_path) as f:
        tail = f.read()[-4000:]
    if proc.returncode != 0:
        raise RuntimeError(f"diffrl train exited with {proc.returncode}:\n{tail}")
    return read_flow(workdir)


def read_flow(workdir: str) -> dict:
    """The metrics of the `diffrl train` run kept in `workdir` (by run_flow, in this call or an earlier one)."""
    from mlflow.tracking import MlflowClient

    with open(os.path.join(workdir, "train.log")) as f:
        tail = f.read()[-4000:]
    with open(os.path.join(workdir, "flow_wall_seconds")) as f:
        wall = float(f.read())

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    run_id = runs[0].info.run_id

    def series(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    per_step = {key: series(key) for key in STAGE_KEYS}
    startup = {k.split("/", 1)[1]: v for k, v in runs[0].data.metrics.items() if k.startswith("startup_s/")}
    return {"wall_seconds": wall, "per_step": per_step, "startup_s": startup, "log_tail": tail[-1500:]}


def run_engines(
    config: str,
    overrides: list[str],
    steps: int,
    *,
    durable: bool = False,
    trace_path: str | None = None,
    on_step: Callable[[dict], object] | None = None,
    keys: tuple[str, ...] = STAGE_KEYS,
) -> dict:
    """The engines-only loop: the flow's engines without a store (with `durable`: with the run's Lance store, its
    background writer and checkpoints, still without Prefect and MLflow), stepped through the same step core.
    `on_step` gets the record so far after every step (a partial result survives a call stopped at its limit);
    `keys` are the metrics kept per step."""
    import torch

    from diffrl.configs.schema import load_experiment
    from diffrl.engines import trace
    from diffrl.engines.step.run import DirectStages, StepClock, add_perf, run_step
    from diffrl.flows.build import build_engines

    cfg = load_experiment(config, overrides)
    if trace_path:
        trace.enable(trace_path)
    torch.manual_seed(cfg.run.seed)
    started = time.perf_counter()
    engines = build_engines(cfg, durable=durable)
    build_s = time.perf_counter() - started
    stages, clock, per_step = DirectStages(engines), StepClock(), []
    for step in range(steps):
        metrics = add_perf(run_step(engines, step, stages).metrics, clock.lap())
        per_step.append({k: metrics.get(k) for k in keys})
        print(f"engines step {step + 1}/{steps}: {metrics['perf/time_per_step']:.3f} s", file=sys.stderr, flush=True)
        trace.flush()
        if on_step is not None:
            on_step({"build_seconds": build_s, "per_step": per_step})
    engines.memory.drain()
    engines.memory.close()
    trace.disable()
    return {"build_seconds": build_s, "per_step": per_step}


def folder_bytes(path: str) -> dict[str, int]:
    """Bytes under each entry of a run folder (the Lance tables, checkpoints, persisted results)."""
    out = {}
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        out[entry] = (
            sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(full) for f in files)
            if os.path.isdir(full)
            else os.path.getsize(full)
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment config (a shipped name or a YAML path)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the `diffrl train` run may take")
    parser.add_argument("--keep", default=None, help="keep the flow's working directory here (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument(
        "--durable",
        action="store_true",
        help="also run the engines with the Lance store and checkpoints (no Prefect, no MLflow): what the writes cost",
    )
    parser.add_argument(
        "--flow-only",
        action="store_true",
        help="run `diffrl train` only and keep it in --keep (a model too large for both runs in one device call)",
    )
    parser.add_argument(
        "--flow-from", default=None, help="read the flow run a --flow-only call kept in this folder; run the engines"
    )
    parser.add_argument(
        "--engines-only",
        action="store_true",
        help="run the engines-only loop alone and write its result (no `diffrl train`: steps that take minutes)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="record both runs' timelines (run.trace): the flow's in its run folder's trace/, the engines' in "
        "engines-trace.json beside it",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the pair (flow, then engines) this many times; medians over all of them (run-to-run noise was "
        "+-6 %% on an H200 for the shapes recipe)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or (args.repeats > 1 and (args.flow_only or args.flow_from or args.engines_only)):
        raise SystemExit("--repeats must be >= 1, and 1 with --flow-only / --flow-from / --engines-only")
    if args.engines_only and (args.flow_only or args.flow_from or args.durable):
        raise SystemExit("--engines-only runs no flow: leave out --flow-only, --flow-from and --durable")
    if args.flow_only and not args.keep:
        raise SystemExit("--flow-only needs --keep DIR (where the next call's --flow-from finds the run)")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    overrides = [*args.overrides, f"run.steps={args.steps}", "run.validate_every=0", "run.name=train-e2e"]
    if args.trace:
        overrides.append("run.trace=true")
    workdir = args.keep or tempfile.mkdtemp(prefix="train_e2e_")
    os.makedirs(workdir, exist_ok=True)
    config = args.config if not os.path.exists(args.config) else os.path.abspath(args.config)
    if args.engines_only:
        return engines_only_result(args, config, overrides, workdir, argv)

    if args.flow_only or not args.flow_from:
        flow = run_flow(config, [*overrides, f"run.root={workdir}/runs"], workdir, args.timeout)
        if args.flow_only:
            print(f"flow run kept in {workdir}; next: --flow-from {workdir} (same config and overrides)")
            if args.out:  # the flow's own figures (a run whose engines-only twin is not wanted, e.g. a vLLM server's)
                return flow_only_result(args, flow, config, overrides, workdir, argv)
            return {}
    else:
        flow = read_flow(args.flow_from)
        workdir = args.flow_from
    engines = run_engines(
        config,
        [*overrides, f"run.root={workdir}/engines-runs"],
        args.steps,
        trace_path=os.path.join(workdir, "engines-trace.json") if args.trace else None,
    )
    pairs = [(flow, engines)]
    for k in range(1, args.repeats):  # flow, engines, flow, engines, ...: drift on the machine hits both alike
        again = os.path.join(workdir, f"repeat{k}")
        os.makedirs(again, exist_ok=True)
        pairs.append(
            (
                run_flow(config, [*overrides, f"run.root={again}/runs"], again, args.timeout),
                run_engines(config, [*overrides, f"run.root={again}/engines-runs"], args.steps),
            )
        )
    durable = (
        run_engines(config, [*overrides, f"run.root={workdir}/durable-runs"], args.steps, durable=True)
        if args.durable
        else None
    )

    import torch

    from diffrl.configs.schema import load_experiment

    cfg = load_experiment(config, overrides)
    timed = list(range(args.warmup + 1, args.steps + 1))  # MLflow steps are 1-based

    def flow_times(run: dict) -> list[float]:
        return [run["per_step"]["perf/time_per_step"][s] for s in timed]

    def engine_times(run: dict) -> list[float]:
        return [run["per_step"][s - 1]["perf/time_per_step"] for s in timed]

    # medians over the timed steps of every repeat together
    flow_s = statistics.median(t for f, _ in pairs for t in flow_times(f))
    engine_s = statistics.median(t for _, e in pairs for t in engine_times(e))
    images = cfg.rollout.samples_per_step
    run_bytes = folder_bytes(os.path.join(workdir, "runs", "train-e2e"))
    device = device_name(cfg)

    def medians(series: dict[int, float]) -> float | None:
        values = [series[s] for s in timed if s in series]
        return statistics.median(values) if values else None

    result = {
        "benchmark": "train_e2e",
        "config": args.config,
        "overrides": args.overrides,
        "device": device,
        "torch": torch.__version__,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "images_per_step": images,
        "flow_seconds_per_step": flow_s,
        "engine_seconds_per_step": engine_s,
        "flow_over_engine": flow_s / engine_s,
        "repeats": args.repeats,
        "flow_over_engine_each": [
            statistics.median(flow_times(f)) / statistics.median(engine_times(e)) for f, e in pairs
        ],
        "flow_mean_seconds_per_step": statistics.mean(t for f, _ in pairs for t in flow_times(f)),
        "engine_mean_seconds_per_step": statistics.mean(t for _, e in pairs for t in engine_times(e)),
        "durable_engine_seconds_per_step": (
            statistics.median(durable["per_step"][s - 1]["perf/time_per_step"] for s in timed) if durable else None
        ),
        "durable_engine_stage_medians_s": (
            {
                k: medians({i + 1: e[k] for i, e in enumerate(durable["per_step"]) if e.get(k) is not None})
                for k in STAGE_KEYS
            }
            if durable
            else None
        ),
        "flow_images_per_gpu_s": images / flow_s,
        "engine_images_per_gpu_s": images / engine_s,
        **video_rates(cfg, flow_s),
        **video_rates(cfg, flow_s, prefix="flow_"),
        **video_rates(cfg, engine_s, prefix="engine_"),
        "flow_stage_medians_s": {k: medians(v) for k, v in flow["per_step"].items()},
        "engine_stage_medians_s": {
            k: medians({i + 1: e[k] for i, e in enumerate(engines["per_step"]) if e.get(k) is not None})
            for k in STAGE_KEYS
        },
        "startup_s": flow["startup_s"],
        "flow_wall_seconds": flow["wall_seconds"],
        "engine_build_seconds": engines["build_seconds"],
        "run_folder_bytes": run_bytes,
        "bytes_per_step": sum(run_bytes.values()) / args.steps,
        "bytes_per_sample": sum(run_bytes.values()) / args.steps / images,
        "keep_latents_steps": cfg.run.keep_latents_steps,
        "flow_seconds_each": [flow["per_step"]["perf/time_per_step"].get(s) for s in range(1, args.steps + 1)],
        "engine_seconds_each": [e["perf/time_per_step"] for e in engines["per_step"]],
        "flow_reward_each": [flow["per_step"]["critic/rewards/mean"].get(s) for s in range(1, args.steps + 1)],
        "engine_reward_each": [e["critic/rewards/mean"] for e in engines["per_step"]],
        "flow_stages_each": {k: [v.get(s) for s in range(1, args.steps + 1)] for k, v in flow["per_step"].items()},
        "engine_stages_each": {k: [e.get(k) for e in engines["per_step"]] for k in STAGE_KEYS},
        "flow_log_tail": flow["log_tail"],
        "command": " ".join(["python", "-m", "benchmarks.train_e2e", *(argv if argv is not None else sys.argv[1:])]),
    }
    common.write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_each") and k != "flow_log_tail"}, indent=1))
    return result


def video_rates(cfg, seconds: float | None, prefix: str = "") -> dict:
    """`{prefix}videos_per_gpu_s` and `{prefix}frames_per_gpu_s` of a video run (rollout.num_frames > 1) whose step
    took `seconds` on one GPU, with the frames a video and the videos a step; {} for an image run."""
    frames = cfg.rollout.num_frames
    if frames <= 1 or not seconds:
        return {}
    videos = cfg.rollout.samples_per_step
    return {
        "frames_per_video": frames,
        "videos_per_step": videos,
        f"{prefix}videos_per_gpu_s": videos / seconds,
        f"{prefix}frames_per_gpu_s": videos * frames / seconds,
    }


def trace_seconds(path: str, steps: int) -> dict[str, dict[str, float]]:
    """The bars of a run.trace timeline summed by name: {name: {"per_step_s", "count", "max_s"}} (every step)."""
    from diffrl.engines import trace

    bars: dict[str, list[float]] = {}
    for event in trace.read(path):
        if event.get("ph") == "X":
            bars.setdefault(event["name"], []).append(event["dur"] / 1e6)
    return {name: {"per_step_s": sum(d) / steps, "count": len(d), "max_s": max(d)} for name, d in sorted(bars.items())}


def engines_only_result(args, config: str, overrides: list[str], workdir: str, argv) -> dict:
    """The JSON of an `--engines-only` call, rewritten after every step ("complete" false until the last): the
    engines-only loop's per-step series, their medians after the warm-up, images (and videos, frames) per GPU per
    second, peak memory, and with --trace the timeline's bars."""
    from diffrl.configs.schema import load_experiment

    cfg = load_experiment(config, overrides)
    trace_path = os.path.join(workdir, "engines-trace.json") if args.trace else None

    def record(engines: dict, complete: bool = False) -> dict:
        result = engines_json(args, cfg, engines, trace_path, argv, complete=complete)
        common.write_json(args.out, result)
        return result

    engines = run_engines(
        config, [*overrides, f"run.root={workdir}/engines-runs"], args.steps, trace_path=trace_path, on_step=record
    )
    result = record(engines, complete=True)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_each")}, indent=1))
    return result


def engines_json(args, cfg, engines: dict, trace_path: str | None, argv, *, complete: bool) -> dict:
    """An engines-only result from the steps run so far (medians None until a step after the warm-up ran)."""
    import torch

    per_step = engines["per_step"]
    timed = per_step[args.warmup :]
    medians = {}
    for key in STAGE_KEYS:
        values = [e[key] for e in timed if e.get(key) is not None]
        medians[key] = statistics.median(values) if values else None
    seconds = medians["perf/time_per_step"]
    return {
        "benchmark": "train_e2e (engines only)",
        "complete": complete,
        "config": args.config,
        "overrides": args.overrides,
        "device": device_name(cfg),
        "torch": torch.__version__,
        "steps": args.steps,
        "steps_done": len(per_step),
        "warmup_steps": args.warmup,
        "images_per_step": cfg.rollout.samples_per_step,
        "engine_seconds_per_step": seconds,
        "engine_images_per_gpu_s": cfg.rollout.samples_per_step / seconds if seconds else None,
        **video_rates(cfg, seconds),
        "engine_stage_medians_s": medians,
        # the process's CUDA peak so far, logged every update (None on the CPU): the run's peak is the last step's
        "peak_memory_allocated_gib": per_step[-1].get("perf/max_memory_allocated_gb") if per_step else None,
        "peak_memory_reserved_gib": per_step[-1].get("perf/max_memory_reserved_gb") if per_step else None,
        "engine_build_seconds": engines["build_seconds"],
        "engine_trace_s": trace_seconds(trace_path, len(per_step)) if trace_path and per_step else None,
        "engine_seconds_each": [e["perf/time_per_step"] for e in per_step],
        "engine_stages_each": {k: [e.get(k) for e in per_step] for k in STAGE_KEYS},
        "command": " ".join(["python", "-m", "benchmarks.train_e2e", *(argv if argv is not None else sys.argv[1:])]),
    }


def device_name(cfg) -> str:
    """The GPU the run used, or the CPU's description."""
    import torch

    if torch.cuda.is_available() and cfg.model.device != "cpu":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def flow_only_result(args, flow: dict, config: str, overrides: list[str], workdir: str, argv) -> dict:
    """The JSON of a `--flow-only --out` call: `diffrl train`'s per-step series, their medians after the warm-up,
    its startup and bytes (no engines-only run, no ratio)."""
    import torch

    from diffrl.configs.schema import load_experiment

    cfg = load_experiment(config, overrides)
    timed = range(args.warmup + 1, args.steps + 1)
    medians = {}
    for key, series in flow["per_step"].items():
        values = [series[s] for s in timed if s in series]
        medians[key] = statistics.median(values) if values else None
    samples = cfg.rollout.samples_per_step
    result = {
        "benchmark": "train_e2e (diffrl train only)",
        "config": args.config,
        "overrides": args.overrides,
        "device": device_name(cfg),
        "torch": torch.__version__,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "samples_per_step": samples,
        "flow_seconds_per_step": medians.get("perf/time_per_step"),
        "flow_samples_per_gpu_s": medians.get("perf/throughput"),
        **video_rates(cfg, medians.get("perf/time_per_step")),
        "flow_stage_medians_s": medians,
        "flow_stages_each": {k: [v.get(s) for s in range(1, args.steps + 1)] for k, v in flow["per_step"].items()},
        "startup_s": flow["startup_s"],
        "flow_wall_seconds": flow["wall_seconds"],
        "run_folder_bytes": folder_bytes(os.path.join(workdir, "runs", "train-e2e")),
        "flow_log_tail": flow["log_tail"],
        "command": " ".join(["python", "-m", "benchmarks.train_e2e", *(argv if argv is not None else sys.argv[1:])]),
    }
    common.write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_each") and k != "flow_log_tail"}, indent=1))
    return result


if __name__ == "__main__":
    main()
