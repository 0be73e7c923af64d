"""docs/leaderboard.md and its two plots from the run records of benchmarks/leaderboard.py (one JSON per run).

Per algorithm, over its seeds: held-out strict accuracy before training and at the end of the budget (mean and
sample standard deviation), the final accuracy per GenEval category, images seen, seconds of training, and the time
to +10 points (the training seconds of the first evaluation at least 10 points above that run's own start; the mean
over the seeds that got there, with how many did). Plots: mean accuracy against training seconds and against images
seen, one line per algorithm (the seeds' evaluations are averaged by their index: every run evaluates at the same
multiples of --eval-every-s). An algorithm whose mean final accuracy is not above its mean start is listed with its
diagnosis (DIAGNOSES), or flagged as lacking one.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from leaderboard import GAIN, ROWS  # noqa: E402

from diffrl.engines.store.scenes import TAGS  # noqa: E402

# Why an algorithm does not learn on this task, once it has been looked into (text for docs/leaderboard.md).
DIAGNOSES: dict[str, str] = {}


def load_runs(results_dir: str) -> dict[str, list[dict]]:
    """The run records in results_dir by algorithm, in the leaderboard's row order, seeds sorted."""
    runs: dict[str, list[dict]] = {}
    for name in sorted(os.listdir(results_dir)):
        if name.endswith(".json"):
            with open(os.path.join(results_dir, name)) as f:
                record = json.load(f)
            if "algorithm" in record and record.get("history"):
                runs.setdefault(record["algorithm"], []).append(record)
    order = [r.name for r in ROWS]
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
        "per_tag": {},
    }
    for tag in TAGS:
        values = [r["history"][-1].get(f"accuracy/{tag}") for r in records]
        if all(v is not None for v in values):
            summary["per_tag"][tag] = statistics.fmean(values)
    summary["learns"] = summary["final"][0] > summary["before"][0]
    return summary


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
        "| time to +10 points |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for a in order:
        s = summaries[a]
        n = len(s["seeds"])
        t, reached = s["time_to_gain"]
        to_gain = f"{t:.0f} s ({reached}/{n} seeds)" if t is not None else f"not reached (0/{n})"
        flag = "" if s["finished"] else " (unfinished)"
        lines.append(
            f"| {a}{flag} | {n} | {_pct(s['before'], n)} | {_pct(s['final'], n)} | "
            f"{100 * (s['final'][0] - s['before'][0]):+.1f} | {s['images']:.0f} | {s['train_s']:.0f} | {to_gain} |"
        )
    lines += ["", "Final accuracy per category (%, mean over seeds):", ""]
    lines.append("| algorithm | " + " | ".join(TAGS) + " |")
    lines.append("| --- |" + " --- |" * len(TAGS))
    for a in order:
        tags = summaries[a]["per_tag"]
        lines.append(f"| {a} | " + " | ".join(f"{100 * tags[t]:.1f}" if t in tags else "-" for t in TAGS) + " |")
    return lines


def write_report(results_dir: str, doc_path: str, images_dir: str) -> dict:
    """Write the doc and the two PNGs; return the summaries by algorithm."""
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
    lines = [
        "# The algorithm leaderboard",
        "",
        "Every diffusion algorithm of the catalog on the reference shapes model with the geneval_lite reward, the same",
        "prompts and sampling, and an equal budget of training seconds per run (benchmarks/leaderboard.py; held-out",
        "strict accuracy on data/shapes_heldout.jsonl, ODE samples; generated by benchmarks/leaderboard_report.py).",
        "",
        f"Device: {first['device']}. Budget: {first['budget_s']:.0f} s of training per run, evaluated every "
        f"{first['eval_every_s']:.0f} s ({first['val_prompts']} prompts x {first['val_samples_per_prompt']} images). "
        f"Base config: `{first['config']}`.",
        "",
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
        lines.append("None: every algorithm's mean final accuracy is above its mean start.")
    lines += ["", "## Settings of each row", ""]
    for row in ROWS:
        if row.name in runs:
            lines.append(f"- **{row.name}**: {row.source}. Overrides: `{' '.join(row.overrides)}`")
    lines += ["", "Reproduce each run with the `command` in its record (benchmarks/results/leaderboard/).", ""]
    with open(doc_path, "w") as f:
        f.write("\n".join(lines))
    return summaries
