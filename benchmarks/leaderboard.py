"""The algorithm leaderboard: every diffusion algorithm of the catalog on the reference shapes model, the
geneval_lite reward and the same prompts, for an equal budget of training seconds per run, over several seeds.

Each run drives the step core the `rl_step` flow runs (diffrl/engines/step/run.py run_step, engines only, as
benchmarks/shapes_rl.py does) on `--config` (default: the GPU recipe diffrl/configs/shapes_flow_grpo.yaml) with its
row's overrides (ROWS in leaderboard_rows.py: each row's settings and where they come from). Training stops at the
first step that ends past `--budget-s` seconds of training (evaluation excluded). Held-out strict accuracy on
data/shapes_heldout.jsonl (the config's data.val, ODE samples, per category) is measured before training and every
`--eval-every-s` seconds of training, with the images seen so far. One JSON per run goes to `--out-dir` (default
benchmarks/results/leaderboard/), rewritten after each evaluation; a run whose JSON says "finished" is skipped, so
a series of calls shorter than the whole leaderboard finishes it (`--deadline-s`: start no run that would end past
it). A distilling row (diffusion_opd) distils the policy its teacher row (flow_grpo) trains for the same budget and
seed: the first run of such a row in an out-dir trains that teacher first, into `teachers/` there (its record and its
LoRA, reused by later runs; no network and no earlier run needed). `--parallel K` runs up to K of them at once on
the one GPU, each in its own child process (benchmarks/leaderboard_parallel.py), and `probe` measures how much of
its solo speed a run keeps at each K.

    python -m benchmarks.leaderboard run --seeds 0 1 --budget-s 300 --deadline-s 560   # GPU: the next runs
    python -m benchmarks.leaderboard probe --parallel 1 2 3 4 --seconds 60 --out probe.json   # GPU: choose K
    python -m benchmarks.leaderboard run --seeds 0 1 --budget-s 300 --parallel 3 --deadline-s 540   # K at once
    python -m benchmarks.leaderboard run --algorithms flow_grpo dpo --seeds 2            # some rows only
    python -m benchmarks.leaderboard run --algorithms diffusion_opd dgpo gardo flow_grpo_ema_ref sft --seeds 0 1 2 \
        --budget-s 300 --eval-every-s 60 --parallel 9 --by-row   # GPU: OPD's teachers train beside the first rows
    python -m benchmarks.leaderboard report      # docs/leaderboard.md's table + docs/images/leaderboard_*.png
    python -m benchmarks.leaderboard run --miniature --out-dir /tmp/lb   # CPU: 2 rows, 1 seed, ~1 minute
    python -m benchmarks.leaderboard report --results /tmp/lb --doc /tmp/lb/leaderboard.md --images /tmp/lb
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common import write_json
from benchmarks.leaderboard_parallel import probe, run_parallel
from benchmarks.leaderboard_report import write_report
from benchmarks.leaderboard_rows import (
    ALL_ROW_NAMES,
    GPU_CONFIG,
    MINIATURE,
    REPO,
    RESULTS,
    RESULTS_ASYNC,
    RESULTS_OTHER_DEVICE,
    ROW_NAMES,
    ROWS,
    Plan,
    Row,
    finished_run,
    run_path,
)


def run_one(
    row: Row,
    seed: int,
    *,
    config: str,
    extra: list[str],
    budget_s: float,
    eval_every_s: float,
    out_dir: str,
    command: str,
    concurrent_runs: int = 1,
    barrier: str | None = None,
    budget_images: int | None = None,
    eval_every_images: int | None = None,
    lora_out: str | None = None,
) -> dict:
    """Train one (row, seed) for `budget_s` seconds of training, evaluating every `eval_every_s` of them (with
    `budget_images`: for that many images seen, evaluating every `eval_every_images`); the record is rewritten after
    each evaluation (a run cut short keeps what it measured, "finished": false).

    `concurrent_runs` is how many runs the parent started together on this device (recorded: the budget is seconds
    of a shared GPU); with `barrier` (a folder), training starts only once that many runs have reached it. A row
    with a teacher first gets it (row_teacher); with `lora_out`, the trained LoRA is written there at the end."""
    import torch

    from benchmarks.shapes_rl import evaluate
    from diffrl.configs.schema import load_experiment
    from diffrl.engines.step.run import DirectStages, StepClock, run_step
    from diffrl.engines.train.checkpoint import export_lora
    from diffrl.flows.build import build_engines

    teacher, overrides = None, list(row.overrides)
    if row.teacher is not None:
        common = dict(config=config, extra=extra, budget_s=budget_s, out_dir=out_dir, command=command)
        teacher = row_teacher(row, seed, **common, concurrent_runs=concurrent_runs, budget_images=budget_images)
        overrides += [f"model.teacher={teacher['model']}", f"model.teacher_lora={teacher.pop('lora_path')}"]
    cfg = load_experiment(config, [*overrides, f"run.seed={seed}", *extra])
    if not cfg.model.path.startswith("reference:shapes") or not cfg.data.val:
        raise SystemExit("the leaderboard runs on the shapes models (model.path reference:shapes*) with a data.val")
    device, _ = cfg.model.device_and_dtype()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if concurrent_runs > 1:  # K runs share the cores (the reward, the CPU side of a step) rather than each taking all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // concurrent_runs))
    torch.manual_seed(seed)
    engines = build_engines(cfg, durable=False)
    stages = DirectStages(engines)
    path = run_path(out_dir, row.name, seed, device_name)
    history, step_seconds = [], []
    record = {
        "algorithm": row.name,
        "seed": seed,
        "config": config,
        "overrides": [*row.overrides, *extra],  # a teacher's: in "teacher"
        "source": row.source,
        **({"teacher": teacher} if teacher else {}),
        "device": device_name,
        "torch": torch.__version__,
        "budget_s": budget_s,
        "eval_every_s": eval_every_s,
        "budget_images": budget_images,
        "eval_every_images": eval_every_images,
        "max_staleness": cfg.run.async_.max_staleness,
        "concurrent_runs": concurrent_runs,
        "samples_per_step": cfg.rollout.samples_per_step,
        "val_prompts": len(engines.val_prompts),
        "val_samples_per_prompt": cfg.data.val_samples_per_prompt,
        "command": command,
        "history": history,
        "finished": False,
    }

    def evaluate_now(step: int, train_s: float, images: int) -> None:
        engines.memory.drain()  # a rollout run ahead for the next step must not run beside the evaluation
        history.append(
            {
                "step": step,
                "train_s": train_s,
                "images": images,
                **evaluate(engines.rollout, engines.reward, cfg, engines.val_prompts),
            }
        )
        record["steps_per_s"] = len(step_seconds) / train_s if train_s else None
        record["train_images_per_s"] = images / train_s if train_s else None
        write_json(path, record)
        print(json.dumps({"algorithm": row.name, "seed": seed, **history[-1]}), flush=True)

    evaluate_now(0, 0.0, 0)
    if barrier:
        wait_at_barrier(barrier, concurrent_runs)
    clock, train_s, images, step = StepClock(), 0.0, 0, 0
    by_images = budget_images is not None
    budget, every = (budget_images, eval_every_images) if by_images else (budget_s, eval_every_s)

    def spent() -> float:  # what the budget counts: images seen, or seconds of training
        return images if by_images else train_s

    next_eval = every
    while spent() < budget and step < cfg.run.steps:
        metrics = run_step(engines, step, stages).metrics
        step += 1
        step_seconds.append(clock.lap())
        train_s += step_seconds[-1]
        images += int(metrics.get("rollout/samples", cfg.rollout.samples_per_step))
        if "async/staleness_max" in metrics:  # the policy versions the trained samples were behind, at most
            record["staleness_max"] = max(record.get("staleness_max", 0.0), metrics["async/staleness_max"])
            record["async_dropped"] = record.get("async_dropped", 0.0) + metrics.get("async/dropped", 0.0)
        if spent() >= next_eval or spent() >= budget or step == cfg.run.steps:
            with clock.excluded():
                evaluate_now(step, train_s, images)
            while next_eval <= spent():
                next_eval += every
    if lora_out is not None:
        export_lora(engines.trainer, lora_out)
    record["finished"] = True
    record["seconds_per_step_median"] = statistics.median(step_seconds) if step_seconds else None
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    write_json(path, record)
    return record


def row_teacher(
    row: Row,
    seed: int,
    *,
    config: str,
    extra: list[str],
    budget_s: float,
    out_dir: str,
    command: str,
    concurrent_runs: int,
    budget_images: int | None,
) -> dict:
    """The teacher of a distilling row's run: the base model with the LoRA of `row.teacher`'s run of this seed, for the
    same budget, under out_dir/teachers/<teacher>_seed<k>/ (its record and pytorch_lora_weights.safetensors). When
    that folder has no LoRA yet it trains that run first, evaluated before and at the end only."""
    from diffrl.configs.schema import load_experiment
    from diffrl.engines.train.checkpoint import LORA_FILE

    folder = os.path.join(out_dir, "teachers", f"{row.teacher}_seed{seed}")
    lora = os.path.join(folder, LORA_FILE)
    if not os.path.isfile(lora):
        teacher_row = next(r for r in ROWS if r.name == row.teacher)
        print(f"{row.name} seed {seed}: training its teacher, the {row.teacher} row, into {folder}", flush=True)
        os.makedirs(folder, exist_ok=True)
        run_one(
            teacher_row,
            seed,
            config=config,
            extra=extra,
            budget_s=budget_s,
            eval_every_s=budget_s,
            out_dir=folder,
            command=command,
            concurrent_runs=concurrent_runs,
            budget_images=budget_images,
            eval_every_images=budget_images,
            lora_out=folder,
        )
    record, history = finished_run(folder, row.teacher, seed), []
    if record:
        with open(os.path.join(folder, record)) as f:
            history = json.load(f)["history"]
    return {
        "row": row.teacher,
        "model": load_experiment(config, extra).model.path,
        "lora": os.path.relpath(lora, REPO) if os.path.abspath(lora).startswith(REPO + os.sep) else lora,
        "lora_path": os.path.abspath(lora),
        "record": record,
        "accuracy": [history[0]["accuracy"], history[-1]["accuracy"]] if history else None,
    }


def plan_of(args: argparse.Namespace) -> Plan:
    """The Plan of a `run` or `probe` call, checked."""
    config, extra = args.config, list(args.overrides)
    names, seeds = args.algorithms or list(ROW_NAMES), args.seeds
    budget_s, eval_every_s = args.budget_s, args.eval_every_s
    budget_images, eval_every_images = getattr(args, "budget_images", None), getattr(args, "eval_every_images", None)
    if args.miniature:
        config, names, seeds = MINIATURE["config"], args.algorithms or list(MINIATURE["algorithms"]), seeds[:1]
        budget_s, eval_every_s = MINIATURE["budget_s"], MINIATURE["eval_every_s"]
        extra = [*MINIATURE["overrides"], *extra]
    unknown = sorted(set(names) - set(ALL_ROW_NAMES))
    if unknown:
        raise SystemExit(f"unknown leaderboard rows {unknown}; the rows: {list(ALL_ROW_NAMES)}")
    if eval_every_s <= 0 or budget_s <= 0:
        raise SystemExit("--budget-s and --eval-every-s must be > 0")
    if budget_images is not None:
        eval_every_images = eval_every_images or budget_images
        if budget_images <= 0 or eval_every_images <= 0:
            raise SystemExit("--budget-images and --eval-every-images must be > 0")
    elif eval_every_images is not None:
        raise SystemExit("--eval-every-images needs --budget-images (without it the budget is seconds of training)")
    return Plan(
        config, tuple(names), tuple(seeds), budget_s, eval_every_s, tuple(extra), budget_images, eval_every_images
    )


def run(args: argparse.Namespace) -> list[dict]:
    """The runs not finished yet in `args.out_dir`, in row order and seed by seed, within `--deadline-s`; with
    `--parallel K` > 1, up to K at once in child processes (leaderboard_parallel.run_parallel)."""
    plan = plan_of(args)
    if args.parallel < 1:
        raise SystemExit(f"--parallel must be >= 1, got {args.parallel}")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.parallel > 1:
        return run_parallel(plan, args.out_dir, args.parallel, args.deadline_s, by_row=args.by_row)
    started, done, last_s = time.monotonic(), [], None
    for seed in plan.seeds:
        for row in plan.rows():
            existing = finished_run(args.out_dir, row.name, seed)
            if existing:
                print(f"{row.name} seed {seed}: finished earlier ({existing}), skipped", flush=True)
                continue
            elapsed = time.monotonic() - started
            if args.deadline_s and last_s and elapsed + last_s > args.deadline_s:
                print(f"--deadline-s {args.deadline_s}: {row.name} seed {seed} would end past it; stopping", flush=True)
                return done
            t0 = time.monotonic()
            command = " ".join(
                [
                    "python",
                    "-m",
                    "benchmarks.leaderboard",
                    "run",
                    *plan.extra,
                    "--algorithms",
                    row.name,
                    "--seeds",
                    str(seed),
                    "--config",
                    plan.config,
                    "--budget-s",
                    str(plan.budget_s),
                    "--eval-every-s",
                    str(plan.eval_every_s),
                    *(
                        ["--budget-images", str(plan.budget_images), "--eval-every-images", str(plan.eval_every_images)]
                        if plan.budget_images is not None
                        else []
                    ),
                    *(["--concurrent", str(args.concurrent)] if args.concurrent > 1 else []),
                ]
            )
            done.append(
                run_one(
                    row,
                    seed,
                    config=plan.config,
                    extra=list(plan.extra),
                    budget_s=plan.budget_s,
                    eval_every_s=plan.eval_every_s,
                    out_dir=args.out_dir,
                    command=command,
                    concurrent_runs=args.concurrent,
                    barrier=args.barrier,
                    budget_images=plan.budget_images,
                    eval_every_images=plan.eval_every_images,
                )
            )
            last_s = time.monotonic() - t0
    return done


def wait_at_barrier(folder: str, parties: int, timeout_s: float = 900.0) -> None:
    """Mark this process ready in `folder` and wait until `parties` processes have (the probe's runs start training
    together, whatever their start-up took)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{os.getpid()}.ready"), "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while len([n for n in os.listdir(folder) if n.endswith(".ready")]) < parties:
        if time.monotonic() > deadline:
            raise SystemExit(f"barrier {folder}: fewer than {parties} runs ready after {timeout_s:.0f} s")
        time.sleep(0.05)


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run, as `diffrl train` takes them")
    parser.add_argument("--config", default=GPU_CONFIG)
    parser.add_argument("--miniature", action="store_true", help="the CPU miniature: 2 rows, 1 seed, seconds each")


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="train and evaluate the leaderboard's runs not finished yet")
    _add_plan_arguments(p_run)
    p_run.add_argument(
        "--algorithms",
        nargs="*",
        default=None,
        help=f"rows (default the leaderboard's: {list(ROW_NAMES)}; also {list(ALL_ROW_NAMES[len(ROW_NAMES) :])})",
    )
    p_run.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    p_run.add_argument("--budget-s", type=float, default=300.0, help="seconds of training per run")
    p_run.add_argument("--eval-every-s", type=float, default=30.0, help="seconds of training between evaluations")
    p_run.add_argument("--budget-images", type=int, default=None, help="a budget of images seen instead of seconds")
    p_run.add_argument(
        "--eval-every-images", type=int, default=None, help="images between evaluations (default: the budget)"
    )
    p_run.add_argument("--deadline-s", type=float, default=None, help="start no run that would end past this")
    p_run.add_argument("--out-dir", default=RESULTS)
    p_run.add_argument("--parallel", type=int, default=1, help="runs at once, each in a child process (default 1)")
    p_run.add_argument(
        "--by-row",
        action="store_true",
        help="with --parallel: start every seed of a row before the next row, rows in --algorithms order (a row that"
        " trains its teacher first, named first, overlaps the others' runs)",
    )
    # set by a --parallel parent or the probe in its children: how many runs share the device, and their barrier
    p_run.add_argument("--concurrent", type=int, default=1, help=argparse.SUPPRESS)
    p_run.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    p_probe = sub.add_parser("probe", help="train the first row alone and K at once: images/s per run for each K")
    _add_plan_arguments(p_probe)
    p_probe.add_argument("--parallel", nargs="+", type=int, default=[1, 2, 3, 4], help="the K to measure")
    p_probe.add_argument("--seconds", type=float, default=60.0, help="seconds of training of each run")
    p_probe.add_argument("--out", default=None, help="also write the result JSON here")
    p_report = sub.add_parser("report", help="write the table and the plots from the run records")
    p_report.add_argument("--results", default=RESULTS)
    p_report.add_argument("--async-results", default=RESULTS_ASYNC, help="the asynchronous rows' records")
    p_report.add_argument(
        "--other-device-results",
        nargs="+",
        default=list(RESULTS_OTHER_DEVICE),
        help="folders of rows measured on another device, one call's runs each (with that call's flow_grpo runs)",
    )
    p_report.add_argument("--doc", default=os.path.join(REPO, "docs", "leaderboard.md"))
    p_report.add_argument("--images", default=os.path.join(REPO, "docs", "images"))
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    if args.command == "probe":
        return probe(args)
    return write_report(args.results, args.doc, args.images, args.async_results, args.other_device_results)


if __name__ == "__main__":
    main()
