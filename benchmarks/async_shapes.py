"""Asynchronous training's throughput on one GPU: the shapes recipe synchronous (cluster.mode local, the run-ahead on,
as every local run) against `run.async.max_staleness: 1`, each run alone on the device, in one call.

Each variant is a fresh interpreter that builds the recipe's engines without a store and steps them through the step
core (benchmarks/train_e2e.py `run_engines`: no Prefect, MLflow or checkpoints), one after the other (`--repeats N`:
the variants N times over, in turn). Variants, each on the same config and overrides:

    sync        the recipe as shipped: the synchronous step, old log-probs not recomputed
    sync_tis    synchronous with `train.rollout_correction: tis`: the recompute the asynchronous run pays, no overlap
    async1      `run.async.max_staleness: 1` with `train.rollout_correction: tis`: the next step's rollout beside
                the update

A direct-preference algorithm (`dpo`, `diffusion_nft`, `awm`, `dgpo`: no importance ratio, nothing recomputed) runs
`sync` and `async1` without the correction; its `sync` is the same work in turn, so `hidden_s` and `overlap` use it.

images/s = images a step / the median seconds a step after `--warmup` (over the repeats). `gain` = async1's images/s
over sync's. `hidden_s` = sync_tis's seconds a step less async1's: what running the rollout beside the update saved
over the same work in turn; `overlap` = hidden_s / min(generate, update) of sync_tis (1: the shorter stage hid
entirely behind the longer, 0: the device ran them no faster together than in turn), the input the scaling model
takes for asynchronous steps (benchmarks/scaling_model.py `--overlap`).

    python -m benchmarks.async_shapes --steps 30 --out benchmarks/results/async_shapes_h100.json   # one GPU
    python -m benchmarks.async_shapes --smoke      # the CPU: the tiny shapes model, 3 steps, nothing written
    python -m benchmarks.async_shapes --steps 30 "algorithm={name: diffusion_nft, ...}"   # the leaderboard's NFT row
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
from benchmarks.leaderboard_rows import MINIATURE
from benchmarks.train_e2e import REPO, STAGE_KEYS, device_name, run_engines

CONFIG = "diffrl/configs/shapes_flow_grpo.yaml"
CORRECTION = ("train.rollout_correction=tis",)
VARIANTS = {"sync": (), "sync_tis": CORRECTION, "async1": ("run.async.max_staleness=1", *CORRECTION)}
# a direct-preference loss has no ratio: no correction to set, no recompute to time apart
DIRECT_PREFERENCE_VARIANTS = {"sync": (), "async1": ("run.async.max_staleness=1",)}
KEYS = (
    *STAGE_KEYS,
    "timing_s/sync_rollout_wait",
    "async/staleness_mean",
    "async/staleness_max",
    "rollout_corr/ratio_mean",
    "rollout_corr/ratio_corrected",
)
# --smoke: the CPU shapes model at the leaderboard miniature's sizes (benchmarks/leaderboard_rows.py MINIATURE)
SMOKE = (
    "--config",
    MINIATURE["config"],
    "--steps",
    "3",
    "--warmup",
    "1",
    "algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2, noise_level: 0.7}",
    *(o for o in MINIATURE["overrides"] if o.startswith(("rollout.", "train."))),  # its validation stays off
)


def variants_for(config: str, overrides: list[str]) -> dict[str, tuple[str, ...]]:
    """The variants of the config's algorithm (module docstring): direct preference (final samples) or policy
    gradient."""
    from diffrl.configs.schema import load_experiment

    final_samples = load_experiment(config, list(overrides)).algorithm.needs.data == "final_samples"
    return DIRECT_PREFERENCE_VARIANTS if final_samples else VARIANTS


def run_variant(name: str, config: str, overrides: list[str], steps: int, out: str) -> None:
    """Train `steps` steps of one variant in this process and write its per-step metrics to `out`."""
    variant = variants_for(config, overrides)[name]
    result = run_engines(config, [*overrides, *variant, "run.name=async-shapes"], steps, keys=KEYS)
    common.write_json(out, result)


def summary(
    config: str,
    overrides: list[str],
    runs: dict[str, list[dict]],
    images: int,
    warmup: int,
    variants_run: dict[str, tuple[str, ...]] | None = None,
) -> dict:
    """Medians over the timed steps of each variant's repeats, images/s, the gain and the overlap (module docstring)."""

    variants_run = variants_run or VARIANTS

    def median(name: str, key: str) -> float | None:
        values = [m[key] for run in runs[name] for m in run["per_step"][warmup:] if m.get(key) is not None]
        return statistics.median(values) if values else None

    variants = {}
    for name in runs:
        seconds = median(name, "perf/time_per_step")
        variants[name] = {
            "overrides": list(variants_run[name]),
            "seconds_per_step": seconds,
            "images_per_s": images / seconds,
            "build_seconds": [run["build_seconds"] for run in runs[name]],
            "medians": {k: median(name, k) for k in KEYS if k != "perf/time_per_step"},
            "per_step": [run["per_step"] for run in runs[name]],
        }
    # the same work as async1 in turn: with the recompute (policy gradient), or the plain step (direct preference)
    sync, serial, overlapped = variants["sync"], variants.get("sync_tis", variants["sync"]), variants["async1"]
    hidden = serial["seconds_per_step"] - overlapped["seconds_per_step"]
    shorter = min(serial["medians"]["timing_s/generate"] or 0.0, serial["medians"]["timing_s/update_actor"] or 0.0)
    return {
        "benchmark": "async_shapes",
        "config": config,
        "overrides": overrides,
        "images_per_step": images,
        "warmup_steps": warmup,
        "variants": variants,
        "gain": overlapped["images_per_s"] / sync["images_per_s"],
        "recompute_cost": serial["seconds_per_step"] / sync["seconds_per_step"] - 1.0 if serial is not sync else None,
        "hidden_s": hidden,
        "overlap": hidden / shorter if shorter > 0 else None,
    }


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every variant")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=1, help="the variants this many times over, in turn")
    parser.add_argument("--smoke", action="store_true", help="the CPU shapes model, 3 steps (numbers meaningless)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child: train this variant only
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # ... and write its per-step metrics here
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_intermixed_args([*SMOKE, *given] if "--smoke" in given else given)
    if args.variant:
        return run_variant(args.variant, args.config, args.overrides, args.steps, args.part)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    from diffrl.configs.schema import load_experiment

    cfg = load_experiment(args.config, list(args.overrides))
    config = os.path.abspath(args.config) if os.path.exists(args.config) else args.config  # the children run elsewhere
    variants_run = variants_for(config, list(args.overrides))
    runs: dict[str, list[dict]] = {name: [] for name in variants_run}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name in variants_run:  # one at a time: each run has the device to itself
                part = os.path.join(scratch, f"{name}_{repeat}.json")
                child = [sys.executable, "-m", "benchmarks.async_shapes", "--config", config]
                child += ["--steps", str(args.steps), "--variant", name, "--part", part, *args.overrides]
                subprocess.run(child, check=True, cwd=scratch, env=env)
                with open(part) as f:
                    runs[name].append(json.load(f))
    result = summary(args.config, list(args.overrides), runs, cfg.rollout.samples_per_step, args.warmup, variants_run)
    command = " ".join(["python", "-m", "benchmarks.async_shapes", *given])
    result = {**result, "device": device_name(cfg), "command": command, "steps": args.steps, "repeats": args.repeats}
    for name, v in result["variants"].items():
        print(f"{name}: {v['seconds_per_step']:.3f} s a step, {v['images_per_s']:.1f} images/s", flush=True)
    overlap = "n/a" if result["overlap"] is None else f"{result['overlap']:.3f}"
    recompute = "n/a" if result["recompute_cost"] is None else f"{result['recompute_cost']:+.3f}"
    print(f"gain {result['gain']:.3f}, recompute cost {recompute}, overlap {overlap}", flush=True)
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
