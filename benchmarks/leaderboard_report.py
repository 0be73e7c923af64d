"""docs/leaderboard.md and its two plots from the run records of benchmarks/leaderboard.py (one JSON per run).

Per algorithm, over its seeds: held-out strict accuracy before training and at the end of the budget (mean and
sample standard deviation), the final accuracy per GenEval category, images seen, seconds of training, and the time
to +10 points (the training seconds of the first evaluation at least 10 points above that run's own start; the mean
over the seeds that got there, with how many did). Plots: mean accuracy against training seconds and against images
seen, one line per algorithm (the seeds' evaluations are averaged by their index: every run evaluates at the same
multiples of --eval-every-s). An algorithm whose mean final accuracy is not MIN_GAIN (2 points) above its mean start
is listed with its diagnosis (DIAGNOSES), or flagged as lacking one.

Each run's budget is seconds of training on a GPU shared by the `concurrent_runs` runs started together
(`leaderboard.py run --parallel K`), so budgets are equal across rows only at one K: the page states the K, and a mix
of K among the runs it tabulates is flagged above the table and per row (column "runs at once").
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from benchmarks.leaderboard_rows import ALL_ROWS, ASYNC_ROWS, GAIN
from diffrl.shapes.scenes import TAGS

# Below this mean gain an algorithm counts as not improving: one evaluation (204 prompts x 4 images) at ~6 % accuracy
# has a binomial standard error of ~0.8 points, so a gain under 2 points over a few seeds is within noise.
MIN_GAIN = 0.02

# Why an algorithm does not learn on this task, once it has been looked into (text for docs/leaderboard.md).
DIAGNOSES: dict[str, str] = {
    "dpo": (
        "the paper's beta 5000 (SD1.5, with ODE sampling: `window: final`) saturates the sigmoid on this model, as the"
        " quickstart found on shapes-small (losses up to 140, grad norms up to 2800; diffrl/configs/quickstart_dpo.yaml"
        " uses VeRL-Omni's beta 100). Check on the GPU (benchmarks/results/leaderboard_dpo_beta100/, one H200, 3 seeds"
        " at once, 50 s of training each): with beta 100 and SDE noise 0.7 on all 4 steps (the quickstart's DPO"
        " settings) held-out strict accuracy went 7.2 -> 13.2, 5.8 -> 8.3 and 5.6 -> 12.0 % (+5.0 points on average)"
        " in 22k images, where the beta-5000 row stood at 6.2 -> 6.6 % after 42k. The check ran 3 runs at once for"
        " 50 s, not the table's 9 for 300 s, so it is not a row of the table, and the row keeps the paper's setting."
        " To train DPO on a flow model, take beta 100 with SDE sampling (diffrl/configs/quickstart_dpo.yaml)."
    ),
}

# The page's "How it runs" section (docs/leaderboard.md carries the same text while no GPU run exists:
# tests/benchmarks/test_leaderboard_parallel.py checks that it does).
HOW_IT_RUNS = """## How it runs

- The base config is `diffrl/configs/shapes_flow_grpo.yaml` (4-step CFG-free sampling, 32 prompts x 16 samples a
  step, LoRA r32, lr 3e-4 on a cosine over 600 steps, half-strict geneval_lite). Each row overrides only the
  algorithm (`ROWS` in `benchmarks/leaderboard_rows.py`: its settings and the paper they come from, scaled to this
  model). Every row samples and is evaluated the same way.
- A run trains through the step core (`run_step`, engines only, as `benchmarks/shapes_rl.py`) until the first step
  that ends past `--budget-s` seconds of training (default 300 s); held-out strict accuracy on the 204 prompts of
  `data/shapes_heldout.jsonl` (4 ODE samples each, per GenEval category) is measured before training and at the
  first step past every `--eval-every-s` seconds (default 30 s), with the images seen; evaluation time is not counted.
- One JSON per run (`<algorithm>_seed<k>_<device>.json`), rewritten after every evaluation; a finished run is
  skipped by the next call, and `--deadline-s` starts no run that would end past it (estimated from the last run, or
  with `--parallel` the longest child so far), so the leaderboard (9 rows x 2 seeds x 5 minutes, about 100 minutes
  of GPU one run at a time) fills over several 10-minute GPU calls.
- One shapes run leaves an H200 about half idle (six `shapes_rl.py` runs started together each took 184-189 s for
  ~80 s of solo work), so `run --parallel K` keeps K runs going at once on the one GPU: each is a child process (this
  script's `run` for one row and seed, a fresh interpreter) started in the sequential order as soon as one ends; its
  output goes to `<record stem>.log` beside its JSON, the parent prints each start and end with the exit code, a
  failed child leaves its record "finished": false (with its exit code) without stopping the others, and the parent
  then exits non-zero. Each record has `concurrent_runs` (K; 1 one at a time) and `train_images_per_s` (images
  seen / training seconds: the share of the GPU the run had). On the CPU each child takes its share of the cores.
- **Fairness**: a run's budget is `budget_s` seconds of training wall time on a GPU time-sliced between the contexts
  of the K runs started together, so budgets are equal across rows only when every row ran at the same K. A run of
  the last wave, with fewer neighbours, gets more of the GPU: the parent adds `mean_runs_alongside` (the runs going
  while it ran, itself included, time-weighted) to each record, and `train_images_per_s` shows the share it had. The
  report states K in the header and per row ("runs at once", with the mean over the row's runs), and flags a mix of
  K above the table. A neighbour's evaluations (left out of its own clock) share the GPU with a run's training too;
  every row evaluates alike, so this too is even only at one K.
- `probe` chooses K: it trains the first row (flow_grpo, seed 0; to a temporary folder, one held-out prompt
  evaluated) alone and then K copies at once, their training started together, for `--seconds` of training each,
  and reports each run's training images/s, their mean relative to the solo run and their sum, per K. Take the
  largest K at which a run keeps most of its solo speed (the aggregate gain is what the leaderboard saves). The
  probe is one 10-minute call (four groups of start-up plus 60 s). With `--deadline-s 540` and 300 s budgets a call
  runs about one wave of K runs, so K also sets how many calls the 18 runs take.

<!-- skip: gpu -->
```bash
python -m benchmarks.leaderboard probe --parallel 1 2 3 4 --seconds 60 \\
  --out benchmarks/results/leaderboard_probe_h200.json
python -m benchmarks.leaderboard run --seeds 0 1 --budget-s 300 --parallel K --deadline-s 540   # repeat until done
python -m benchmarks.leaderboard report      # this page, docs/images/leaderboard_{seconds,images}.png
python -m benchmarks.leaderboard run --miniature --out-dir /tmp/lb   # the CPU miniature (2 rows, 1 seed, 8 s each)
python -m benchmarks.leaderboard run --miniature --parallel 2 --out-dir /tmp/lb2   # the same, both at once
python -m benchmarks.leaderboard probe --miniature --parallel 1 2 --seconds 3   # the probe on the CPU
```

- The report gives, per algorithm: accuracy before and at the end (mean ± sample s.d. over seeds), the gain, the
  final accuracy per category, images seen, seconds of training, the time to +10 points (the first evaluation
  10 points above the run's own start; mean over the seeds that got there, and how many did), the runs at once,
  the training images/s and the largest peak GPU memory of its runs (torch's allocations). An algorithm whose mean
  final accuracy is not 2 points above its start is listed under "Algorithms that did not improve" with its
  diagnosis (`DIAGNOSES` in `benchmarks/leaderboard_report.py`), or flagged "NO DIAGNOSIS YET".

The learning-rate schedule is the base config's cosine over 600 steps for every row, so a row that runs fewer steps
within the budget ends with a higher learning rate than one that runs more; `run.steps` (600) caps a fast row.
"""


# The page's "Asynchronous rows" section, above their comparison (tests/benchmarks/test_leaderboard_smoke.py checks
# that docs/leaderboard.md carries it).
ASYNC_TEXT = """## Asynchronous rows

`flow_grpo_async1` and `flow_grpo_async2` are the flow_grpo row with `run.async.max_staleness` 1 and 2 and
`train.rollout_correction: tis` (docs/training.md "Asynchronous training"): the next step's rollout samples with a
behaviour copy of the policy while the update trains, and the loss corrects for the samples' age. They are compared
with the on-policy flow_grpo row at an equal number of images seen (`run --budget-images`), 3 seeds each, in their
own folder (`benchmarks/results/leaderboard_async/`), not in the table above (equal seconds of training on a shared
GPU). Per row: held-out strict accuracy at the end of the budget (mean ± sample s.d. over seeds), the difference from
the on-policy row's mean, and whether it is within the on-policy seeds' spread (the on-policy mean ± its s.d.). In
one process the rollout runs at most one step ahead, so `max_staleness: 2` trains samples at most one version old,
as 1 does; each record's `staleness_max` is the largest staleness its run trained. Whether asynchronous training is
faster is measured with each run alone on the GPU (`benchmarks/async_shapes.py`), not here. A run takes ~12.8 GiB:
an H200 holds 9 at once, an H100 (80 GB) 3 (`--parallel`: the budget is images, so how many run at once changes the
seconds, not the result).

<!-- skip: gpu -->
```bash
python -m benchmarks.leaderboard run --algorithms flow_grpo flow_grpo_async1 flow_grpo_async2 --seeds 0 1 2 \\
  --budget-images 10240 --eval-every-images 5120 --parallel 3 \\
  --out-dir benchmarks/results/leaderboard_async      # one H100; --parallel 9 on an H200
python -m benchmarks.leaderboard report      # this page, the comparison below included
python -m benchmarks.leaderboard run --miniature --algorithms flow_grpo flow_grpo_async1 --budget-images 16 \\
  --out-dir /tmp/lba      # the CPU miniature: 2 steps each
```
"""


# The page's "Rows measured on another device" section, above its table (when its folders have records).
OTHER_DEVICE_TEXT = """## Rows measured on another device

These rows ran on another device, with another number of runs at once, than the table above, one call a folder, so
each row is compared with the flow_grpo runs of its own call (the `flow_grpo` line of its table), not with the table
above. In the first call the flow_grpo runs are the teachers the `diffusion_opd` row trains first (`teachers/` in the
out-dir, each seed's record copied beside the others): they are evaluated before and at the end of the budget only,
so their "time to +10 points" is the whole budget whenever they got there. Each run's log is beside its record; a run
that failed to start keeps its log only.

<!-- skip: gpu -->
```bash
python -m benchmarks.leaderboard run --algorithms diffusion_opd dgpo gardo flow_grpo_ema_ref sft --seeds 0 1 2 \\
  --budget-s 300 --eval-every-s 60 --parallel 6 --by-row --out-dir OUT      # one H100 (80 GB): leaderboard_h100/
python -m benchmarks.leaderboard run --algorithms flow_grpo_ema_ref flow_grpo --seeds 0 1 2 \\
  --budget-s 300 --eval-every-s 60 --parallel 6 --by-row --out-dir OUT      # one H100: leaderboard_h100_ema_ref/
```
"""


def other_device_section(calls: dict[str, dict[str, list[dict]]]) -> list[str]:
    """The "Rows measured on another device" section: a table for each folder of `calls` with records (one call's
    runs, as load_runs reads them), under the folder's name (none with records: no section)."""
    lines = []
    for results_dir, runs in calls.items():
        if not runs:
            continue
        # the budget as the rows state it: the flow_grpo runs (teachers) are evaluated at the start and the end only
        first = min((r for records in runs.values() for r in records), key=lambda r: r.get("eval_every_s") or 0)
        failed = sorted(
            name.removesuffix(".log")
            for name in os.listdir(results_dir)
            if name.endswith(".log")
            and not os.path.isfile(os.path.join(results_dir, name.removesuffix(".log") + ".json"))
        )
        lines += [
            f"### `benchmarks/results/{os.path.basename(os.path.normpath(results_dir))}/`",
            "",
            f"Device: {first['device']}. Budget: {budget_text(first)}. Runs at once on the device: "
            f"{', '.join(map(str, sorted({concurrency(r) for records in runs.values() for r in records})))}.",
            "",
            *table(runs),
        ]
        lines += ["", f"Runs that failed to start (their logs): {', '.join(failed)}.", ""] if failed else [""]
    return [OTHER_DEVICE_TEXT, *lines[:-1]] if lines else []


def async_comparison(runs: dict[str, list[dict]]) -> list[dict]:
    """Each asynchronous row of `runs` whose on-policy row is there too: its final accuracy (mean, s.d.), the
    on-policy row's, the difference of the means and whether it is within the on-policy s.d. (None with fewer than
    two on-policy seeds: no spread to be within)."""
    out = []
    for row in ASYNC_ROWS:
        if row.name not in runs or row.on_policy not in runs:
            continue
        mine, theirs = summarize(runs[row.name]), summarize(runs[row.on_policy])
        difference = mine["final"][0] - theirs["final"][0]
        spread = theirs["final"][1] if len(theirs["seeds"]) > 1 else None
        out.append(
            {
                "row": row.name,
                "on_policy": row.on_policy,
                "seeds": mine["seeds"],
                "on_policy_seeds": theirs["seeds"],
                "max_staleness": sorted({r.get("max_staleness") for r in runs[row.name]}),
                "staleness_max": max((r.get("staleness_max", 0.0) for r in runs[row.name]), default=0.0),
                "images": mine["images"],
                "on_policy_images": theirs["images"],
                "final": mine["final"],
                "on_policy_final": theirs["final"],
                "difference": difference,
                "within": None if spread is None else abs(difference) <= spread + 1e-12,
                "device": ", ".join(sorted({r.get("device", "unknown") for r in runs[row.name] + runs[row.on_policy]})),
            }
        )
    return out


def async_section(runs: dict[str, list[dict]]) -> list[str]:
    """The "Asynchronous rows" section: ASYNC_TEXT and the comparison of the records in `runs`, if any."""
    comparisons = async_comparison(runs)
    if not comparisons:
        return [ASYNC_TEXT, "No runs of the asynchronous rows beside the on-policy row yet."]
    lines = [
        ASYNC_TEXT,
        "| row | max_staleness | trained staleness (max) | seeds | images seen | final (%) | on-policy final (%) "
        "| difference (points) | within the on-policy spread | device |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        n, m = len(c["seeds"]), len(c["on_policy_seeds"])
        within = {None: "n/a (one on-policy seed)", True: "yes", False: "no"}[c["within"]]
        lines.append(
            f"| {c['row']} | {', '.join(map(str, c['max_staleness']))} | {c['staleness_max']:.0f} | {n} "
            f"| {c['images']:.0f} (on-policy {c['on_policy_images']:.0f}) | {_pct(c['final'], n)} "
            f"| {_pct(c['on_policy_final'], m)} | {100 * c['difference']:+.1f} | {within} | {c['device']} |"
        )
    return lines


def load_runs(results_dir: str) -> dict[str, list[dict]]:
    """The run records in results_dir by algorithm, in the leaderboard's row order, seeds sorted."""
    runs: dict[str, list[dict]] = {}
    for name in sorted(os.listdir(results_dir)):
        if name.endswith(".json"):
            with open(os.path.join(results_dir, name)) as f:
                record = json.load(f)
            if "algorithm" in record and record.get("history"):
                runs.setdefault(record["algorithm"], []).append(record)
    order = [r.name for r in ALL_ROWS]
    return {a: sorted(runs[a], key=lambda r: r["seed"]) for a in sorted(runs, key=order.index)}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def time_to_gain(record: dict, gain: float = GAIN) -> float | None:
    """Training seconds of the first evaluation at least `gain` above the run's own start, or None."""
    start = record["history"][0]["accuracy"]
    for entry in record["history"][1:]:
        if entry["accuracy"] >= start + gain - 1e-12:
            return entry["train_s"]
    return None


def summarize(records: list[dict]) -> dict:
    """One table row: the statistics of an algorithm's runs (see the module docstring)."""
    before = [r["history"][0]["accuracy"] for r in records]
    final = [r["history"][-1]["accuracy"] for r in records]
    reached = [t for t in (time_to_gain(r) for r in records) if t is not None]
    summary = {
        "seeds": [r["seed"] for r in records],
        "finished": all(r["finished"] for r in records),
        "before": _mean_sd(before),
        "final": _mean_sd(final),
        "images": statistics.fmean(r["history"][-1]["images"] for r in records),
        "train_s": statistics.fmean(r["history"][-1]["train_s"] for r in records),
        "time_to_gain": (statistics.fmean(reached) if reached else None, len(reached)),
        "concurrent_runs": sorted({concurrency(r) for r in records}),
        # runs going at once while these ran, time-weighted (the parent's count: fewer in a last wave)
        "mean_alongside": statistics.fmean(r.get("mean_runs_alongside", concurrency(r)) for r in records),
        "images_per_s": statistics.fmean(
            r["history"][-1]["images"] / r["history"][-1]["train_s"] if r["history"][-1]["train_s"] else 0.0
            for r in records
        ),
        # the largest torch allocation of a run (benchmarks/leaderboard.py records it on a GPU; absent on the CPU)
        "peak_gib": max((r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None), default=None),
        "per_tag": {},
    }
    for tag in TAGS:
        values = [r["history"][-1].get(f"accuracy/{tag}") for r in records]
        if all(v is not None for v in values):
            summary["per_tag"][tag] = statistics.fmean(values)
    summary["learns"] = summary["final"][0] - summary["before"][0] >= MIN_GAIN
    return summary


def concurrency(record: dict) -> int:
    """How many runs shared the GPU as this one trained (records of before `--parallel` ran one at a time)."""
    return record.get("concurrent_runs", 1)


def mixed_concurrency(runs: dict[str, list[dict]]) -> str | None:
    """A warning naming the runs of each K when the records are not all of one K, or None."""
    by_k: dict[int, list[str]] = {}
    for algorithm, records in runs.items():
        for r in records:
            by_k.setdefault(concurrency(r), []).append(f"{algorithm} seed {r['seed']}")
    if len(by_k) < 2:
        return None
    parts = "; ".join(f"K={k}: {', '.join(names)}" for k, names in sorted(by_k.items()))
    return (
        "**Warning: these runs did not all share the GPU with the same number of runs, so their training-second "
        f"budgets are not equal; compare rows of one K only** ({parts})."
    )


def mean_curve(records: list[dict], x: str) -> tuple[list[float], list[float]]:
    """(x, accuracy) averaged over the seeds by evaluation index, as far as every seed has evaluations."""
    n = min(len(r["history"]) for r in records)
    xs = [statistics.fmean(r["history"][i][x] for r in records) for i in range(n)]
    ys = [statistics.fmean(r["history"][i]["accuracy"] for r in records) for i in range(n)]
    return xs, ys


def plot(runs: dict[str, list[dict]], x: str, label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for algorithm, records in runs.items():
        xs, ys = mean_curve(records, x)
        ax.plot(xs, [100 * y for y in ys], marker="o", markersize=3, label=f"{algorithm} ({len(records)} seeds)")
    ax.set_xlabel(label)
    ax.set_ylabel("held-out strict accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pct(mean_sd: tuple[float, float], n: int) -> str:
    mean, sd = mean_sd
    return f"{100 * mean:.1f} ± {100 * sd:.1f}" if n > 1 else f"{100 * mean:.1f}"


def table(runs: dict[str, list[dict]]) -> list[str]:
    """The leaderboard table and the per-category table, as markdown lines, best final accuracy first."""
    summaries = {a: summarize(r) for a, r in runs.items()}
    order = sorted(summaries, key=lambda a: -summaries[a]["final"][0])
    lines = [
        "| algorithm | seeds | before (%) | final (%) | gain (points) | images seen | training s "
        "| time to +10 points | runs at once | training images/s | peak GPU memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in order:
        s = summaries[a]
        n = len(s["seeds"])
        t, reached = s["time_to_gain"]
        to_gain = f"{t:.0f} s ({reached}/{n} seeds)" if t is not None else f"not reached (0/{n})"
        flag = "" if s["finished"] else " (unfinished)"
        ks = ", ".join(map(str, s["concurrent_runs"])) + (" (mixed)" if len(s["concurrent_runs"]) > 1 else "")
        ks += f" (mean {s['mean_alongside']:.1f})" if s["concurrent_runs"] != [1] else ""
        peak = "-" if s["peak_gib"] is None else f"{s['peak_gib']:.1f}"
        lines.append(
            f"| {a}{flag} | {n} | {_pct(s['before'], n)} | {_pct(s['final'], n)} | "
            f"{100 * (s['final'][0] - s['before'][0]):+.1f} | {s['images']:.0f} | {s['train_s']:.0f} | {to_gain} "
            f"| {ks} | {s['images_per_s']:.1f} | {peak} |"
        )
    lines += ["", "Final accuracy per category (%, mean over seeds):", ""]
    lines.append("| algorithm | " + " | ".join(TAGS) + " |")
    lines.append("| --- |" + " --- |" * len(TAGS))
    for a in order:
        tags = summaries[a]["per_tag"]
        lines.append(f"| {a} | " + " | ".join(f"{100 * tags[t]:.1f}" if t in tags else "-" for t in TAGS) + " |")
    return lines


def budget_text(record: dict) -> str:
    """A run's budget in words: seconds of training, or images seen (`run --budget-images`)."""
    if record.get("budget_images") is not None:
        return f"{record['budget_images']} images per run, evaluated every {record['eval_every_images']} images"
    return f"{record['budget_s']:.0f} s of training per run, evaluated every {record['eval_every_s']:.0f} s"


def write_report(
    results_dir: str,
    doc_path: str,
    images_dir: str,
    async_dir: str | None = None,
    other_device_dirs: list[str] | tuple[str, ...] = (),
) -> dict:
    """Write the doc and the two PNGs; return the summaries by algorithm. The asynchronous rows' comparison is made
    from the records in `async_dir` (their own folder: they run at equal images, the table at equal seconds); rows
    measured on another device, from the folders `other_device_dirs` (one call's records each)."""
    runs = load_runs(results_dir)
    if not runs:
        raise SystemExit(f"no leaderboard run records in {results_dir}: run `benchmarks/leaderboard.py run` first")
    os.makedirs(images_dir, exist_ok=True)
    doc_dir = os.path.dirname(os.path.abspath(doc_path))
    pngs = {}
    for x, label, name in (("train_s", "seconds of training", "seconds"), ("images", "images seen", "images")):
        pngs[x] = os.path.join(images_dir, f"leaderboard_{name}.png")
        plot(runs, x, label, pngs[x])
    summaries = {a: summarize(r) for a, r in runs.items()}
    first = next(iter(runs.values()))[0]
    warning = mixed_concurrency(runs)
    if warning:
        print(warning.replace("**", ""), file=sys.stderr, flush=True)
    ks = sorted({concurrency(r) for records in runs.values() for r in records})
    shared = (
        f"Runs at once on the device: {ks[0]}"
        + (
            "."
            if first.get("budget_images")
            else f" (each run's budget is seconds of training on a device shared by {ks[0]} runs)."
        )
        if len(ks) == 1
        else f"Runs at once on the device: MIXED ({', '.join(map(str, ks))})."
    )
    lines = [
        "# The algorithm leaderboard",
        "",
        "Every diffusion algorithm of the catalog on the reference shapes model with the geneval_lite reward, the same",
        "prompts and sampling, and an equal budget of training seconds per run (benchmarks/leaderboard.py; held-out",
        "strict accuracy on data/shapes_heldout.jsonl, ODE samples; generated by benchmarks/leaderboard_report.py).",
        "",
        f"Device: {first['device']}. Budget: {budget_text(first)} ({first['val_prompts']} prompts x "
        f"{first['val_samples_per_prompt']} images). "
        f"Base config: `{first['config']}`. {shared}",
        "",
        *([warning, ""] if warning else []),
        *table(runs),
        "",
        f"![accuracy against training seconds]({os.path.relpath(pngs['train_s'], doc_dir)})",
        f"![accuracy against images seen]({os.path.relpath(pngs['images'], doc_dir)})",
        "",
        "## Algorithms that did not improve",
        "",
    ]
    stuck = [a for a, s in summaries.items() if not s["learns"]]
    for a in stuck:
        lines.append(f"- **{a}**: {DIAGNOSES.get(a, 'NO DIAGNOSIS YET: look into it before publishing this table.')}")
    if not stuck:
        lines.append(
            f"None: every algorithm's mean final accuracy is at least {MIN_GAIN * 100:.0f} points above its mean start."
        )
    lines += ["", *async_section(load_runs(async_dir) if async_dir and os.path.isdir(async_dir) else {}), ""]
    calls = {d: load_runs(d) for d in other_device_dirs if os.path.isdir(d)}
    other_runs = {a for runs in calls.values() for a in runs}
    other = other_device_section(calls)
    lines += [*other, ""] if other else []
    lines += [HOW_IT_RUNS, "## Settings of each row", ""]
    for row in ALL_ROWS:
        if row.name in runs or row.name in other_runs:
            lines.append(f"- **{row.name}**: {row.source}. Overrides: `{' '.join(row.overrides)}`")
    lines += ["", "Reproduce each run with the `command` in its record (benchmarks/results/leaderboard/).", ""]
    with open(doc_path, "w") as f:
        f.write("\n".join(lines))
    return summaries
