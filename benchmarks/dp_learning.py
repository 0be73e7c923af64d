"""Does the direct-preference family learn? Whole `diffrl train` runs on the tiny CPU model.

Runs a config (default: tests/configs/quick_dpo.yaml and quick_nft.yaml) in a fresh working directory and reads
back every sample's reward from runs/<name>/rewards.lance. The check: the mean reward of the last
quarter of the steps exceeds that of the first quarter by more than twice the standard error of the
difference (sqrt(var_first / n_first + var_last / n_last), per-sample rewards). For offline DPO it
reports actor/implicit_acc per step instead. Results go to benchmarks/results/dp_learning_cpu.json.

Why a control: every run of a config samples the same prompts and seeds at each step, and the reward of
the tiny model varies more between steps (prompts) than training moves it, so the raw quarter test can
pass without any learning. `--control` also runs the config with lr 1e-12 (no learning, same samples)
and reports the paired statistic: d = reward(trained) - reward(control) per sample, gain of d between
the first and the last quarter, and its standard error. val/reward (fixed prompts and seeds) is recorded too.

    python -m benchmarks.dp_learning --control                    # quick_dpo and quick_nft, 24 steps each
    python -m benchmarks.dp_learning --configs tests/configs/quick_nft.yaml --steps 12 --out /tmp/nft.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quarter_gain(per_step: list[list[float]]) -> dict:
    """Mean reward of the first and last quarter of the steps, their difference and its standard error."""
    q = max(1, len(per_step) // 4)
    first = [r for step in per_step[:q] for r in step]
    last = [r for step in per_step[-q:] for r in step]

    def mean_var(xs):
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)

    (m1, v1), (m2, v2) = mean_var(first), mean_var(last)
    se = math.sqrt(v1 / len(first) + v2 / len(last))
    return {
        "first_quarter_mean": m1,
        "last_quarter_mean": m2,
        "gain": m2 - m1,
        "stderr": se,
        "gain_over_2se": (m2 - m1) > 2 * se,
        "steps_per_quarter": q,
        "samples_per_quarter": len(first),
    }


def step_rewards(run_dir: str, steps: int) -> list[dict[tuple[str, int], float]]:
    """Every valid sample's reward of each step, keyed by (group_id, sample_index)."""
    from diffrl.engines.store.trajectories import TrajectoryStore

    store = TrajectoryStore(os.path.join(run_dir, "trajectories.lance"))
    out = []
    for step in range(steps):
        traj = store.read_step(step, with_latents=False, with_images=False)
        rewards, _, valid = store.read_rewards(step)
        out.append(
            {
                (g, int(i)): float(r)
                for g, i, r, v in zip(traj.group_ids, traj.sample_index.tolist(), rewards.tolist(), valid.tolist())
                if v
            }
        )
    return out


def paired_gain(trained: list[dict], control: list[dict]) -> dict:
    """quarter_gain of the per-sample differences trained - control (same prompts and seeds)."""
    diffs = [[t[k] - c[k] for k in t if k in c] for t, c in zip(trained, control)]
    return {f"paired_{k}": v for k, v in quarter_gain(diffs).items()}


def metric_history(workdir: str, experiment: str, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def run_one(config: str, steps: int, overrides: list[str]) -> dict:
    """One training run in a temporary working directory; the learning statistics (and `_rewards`)."""
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.train import train

    cfg = load_experiment(config, [f"run.steps={steps}", *overrides])
    workdir = tempfile.mkdtemp(prefix=f"dp_learning_{os.path.basename(config).removesuffix('.yaml')}_")
    here = os.getcwd()
    os.chdir(workdir)
    # mlflow.set_tracking_uri (called by the tracker) exports MLFLOW_TRACKING_URI, which the next run in
    # this process would inherit: each run logs to its own working directory's mlflow.db
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        started = time.perf_counter()
        train(config=config, overrides=[f"run.steps={steps}", *overrides])
        seconds = time.perf_counter() - started
        result = {
            "config": config,
            "overrides": overrides,
            "steps": steps,
            "seconds": round(seconds, 1),
            "algorithm": cfg.algorithm.name,
            "sample_source": cfg.data.sample_source,
        }
        if cfg.data.sample_source == "offline":
            result["implicit_acc"] = metric_history(workdir, cfg.run.experiment, "actor/implicit_acc")
        else:
            result["_rewards"] = step_rewards(cfg.run_dir, steps)
            result.update(quarter_gain([list(r.values()) for r in result["_rewards"]]))
            result["reward_mean_per_step"] = metric_history(workdir, cfg.run.experiment, "critic/rewards/mean")
        result["val_reward"] = metric_history(workdir, cfg.run.experiment, "val/reward")
        return result
    finally:
        os.chdir(here)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tests_configs = os.path.join(ROOT, "tests", "configs")
    default = [os.path.join(tests_configs, f"{name}.yaml") for name in ("quick_dpo", "quick_nft")]
    parser.add_argument("--configs", nargs="+", default=default)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--override", action="append", default=[], help="dotted override, repeatable")
    parser.add_argument("--control", action="store_true", help="also run each config at lr 1e-12 (paired test)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dp_learning_cpu.json"))
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    results = []
    for config in args.configs:
        result = run_one(config, args.steps, args.override)
        if args.control and "_rewards" in result:
            control = run_one(config, args.steps, args.override + ["train.lr=1e-12"])
            result.update(paired_gain(result["_rewards"], control.pop("_rewards")))
            result["control"] = control
        result.pop("_rewards", None)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("reward_mean_per_step", "control")}))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": f"CPU, {os.cpu_count()} cores", "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
