"""Orchestration overhead per RL step on this CPU: Prefect + Lance + MLflow around a near-trivial engine.

Runs the real `train` flow (ephemeral Prefect server, Lance tables, MLflow sqlite) on the tiny SD3
model at 16x16 with 2 denoising steps and 2 samples, so the engines' own work is milliseconds; then
reads the step metrics back from MLflow and reports

    overhead = timing_s/step_total - (timing_s/generate + timing_s/reward + timing_s/update_actor)

i.e. everything a step costs besides the model and reward compute: the rl_step subflow run and its
task runs, Lance writes and reads (PNG encoding included), advantages, the checkpoint commit, weight
sync bookkeeping and the rollout-image logging (MLflow's metric write itself is after the timer).

    python -m benchmarks.orchestration --steps 12 --out benchmarks/results/orchestration_cpu.json

Over a long run it also reports the mean step time of each block of --block steps, which shows whether the
per-step cost grows with the step number (it does without compaction: every Lance append adds a fragment that
later reads open; the flow compacts every run.compact_every steps):

    python -m benchmarks.orchestration --steps 80 --block 10 --out benchmarks/results/orchestration_80_cpu.json
    python -m benchmarks.orchestration --steps 80 --block 10 run.compact_every=0   # without compaction
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

OVERRIDES = [
    "model.path=tiny:sd3",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.train=generator:ocr",
    "data.val=null",
    "rollout.max_sequence_length=null",
    "run.validate_every=0",
    "run.log_images=0",
    "run.checkpoint_every=1000",
    "rollout.num_inference_steps=2",
    "rollout.height=16",
    "rollout.width=16",
    "rollout.group_size=2",
    "rollout.prompts_per_step=1",
    "rollout.chunk_size=2",
    "rollout.batch_size=2",
    "train.mini_batch_prompts=1",
    "train.micro_batch_size=2",
    "data.num_generated=8",
    "data.num_val_prompts=1",
    "algorithm={name: flow_grpo, kl_coef: 0.0, clip_ratio: 0.2}",  # the rl_step flow (the quickstart is DiffusionNFT)
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (imports, first commits)")
    parser.add_argument("--block", type=int, default=0, help="also report the mean step time of each block of N steps")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("overrides", nargs="*", help="more dotted overrides (e.g. run.compact_every=0)")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out) if args.out else None
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import mlflow
    from mlflow.tracking import MlflowClient

    from diffrl.flows.train import train

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        started = time.perf_counter()
        train(config=None, overrides=OVERRIDES + [f"run.steps={args.steps}", "run.name=overhead", *args.overrides])
        wall = time.perf_counter() - started
        mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
        client = MlflowClient()
        run = client.search_runs([client.get_experiment_by_name("diffrl-quickstart").experiment_id])[0]

        def series(key: str) -> dict[int, float]:
            return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

        step_s, gen, rew, upd = (
            series(k) for k in ("timing_s/step_total", "timing_s/generate", "timing_s/reward", "timing_s/update_actor")
        )
        steps = sorted(s for s in step_s if s > args.warmup)
        overhead = [step_s[s] - gen[s] - rew[s] - upd[s] for s in steps]
    result = {
        "benchmark": "orchestration_overhead_per_step",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": sys.version.split()[0],
        "steps_measured": len(steps),
        "overhead_s_median": statistics.median(overhead),
        "overhead_s_mean": statistics.mean(overhead),
        "overhead_s_max": max(overhead),
        "time_per_step_s_median": statistics.median(step_s[s] for s in steps),
        "engine_s_median": statistics.median(gen[s] + rew[s] + upd[s] for s in steps),
        "wall_s_including_startup": wall,
        "overrides": args.overrides,
        **(
            {
                f"time_per_step_s_mean_by_block_of_{args.block}": [
                    statistics.mean(step_s[s] for s in range(b, min(b + args.block, args.steps + 1)) if s in step_s)
                    for b in range(1, args.steps + 1, args.block)
                ]
            }
            if args.block > 0
            else {}
        ),
        "command": "python -m benchmarks.orchestration " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
