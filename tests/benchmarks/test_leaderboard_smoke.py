"""The algorithm leaderboard's harness (benchmarks/leaderboard.py): its CPU miniature -- two rows, one seed,
seconds of training each on the CPU shapes model -- run and reported as the GPU leaderboard is, and the report's
statistics against their closed forms on hand-written records."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from benchmarks import leaderboard, leaderboard_report
from diffrl.shapes.scenes import TAGS  # noqa: E402


@pytest.mark.slow  # ~45 s on 2 cores
def test_the_miniature_trains_two_rows_for_equal_budgets_and_reports_them(tmp_path):
    out, doc = tmp_path / "runs", tmp_path / "leaderboard.md"
    records = leaderboard.main(["run", "--miniature", "--out-dir", str(out)])
    assert [r["algorithm"] for r in records] == ["flow_grpo", "diffusion_nft"]
    for record in records:
        history, budget, every = record["history"], record["budget_s"], record["eval_every_s"]
        assert record["finished"] and (history[0]["step"], history[0]["train_s"], history[0]["images"]) == (0, 0, 0)
        # training stops at the first step that ends past the budget; the one before it was within
        assert history[-1]["train_s"] >= budget and len(history) >= 3
        assert all(e["images"] == e["step"] * record["samples_per_step"] for e in history)
        # one evaluation per interval of training seconds: the first step past each multiple of eval_every_s
        intervals = [math.floor(e["train_s"] / every) for e in history[1:-1]]
        assert intervals == sorted(set(intervals)) and all(i >= 1 for i in intervals)
        assert all(0.0 <= e["accuracy"] <= 1.0 and all(f"accuracy/{t}" in e for t in TAGS) for e in history)
        on_disk = json.loads((out / f"{record['algorithm']}_seed0_cpu.json").read_text())
        assert on_disk == json.loads(json.dumps(record))
    # a second call finds both finished and runs nothing
    assert leaderboard.main(["run", "--miniature", "--out-dir", str(out)]) == []

    summaries = leaderboard.main(["report", "--results", str(out), "--doc", str(doc), "--images", str(tmp_path)])
    text = doc.read_text()
    for record in records:
        final = 100 * record["history"][-1]["accuracy"]
        row = next(line for line in text.splitlines() if line.startswith(f"| {record['algorithm']} | 1 |"))
        assert f"| {final:.1f} |" in row
        assert summaries[record["algorithm"]]["images"] == record["history"][-1]["images"]
    for name in ("leaderboard_seconds.png", "leaderboard_images.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size == (700, 420)
        assert f"]({name})" in text


def _record(seed: int, points: list[tuple[float, int, float]], algorithm: str = "dpo") -> dict:
    history = [{"step": i, "train_s": s, "images": n, "accuracy": a} for i, (s, n, a) in enumerate(points)]
    return {"algorithm": algorithm, "seed": seed, "finished": True, "history": history}


def test_the_report_statistics_match_their_closed_forms(tmp_path):
    runs = [
        _record(0, [(0, 0, 0.10), (30, 512, 0.15), (60, 1024, 0.21), (90, 1536, 0.30)]),
        _record(1, [(0, 0, 0.20), (31, 512, 0.22), (62, 1024, 0.25), (93, 1536, 0.26)]),
    ]
    assert leaderboard_report.time_to_gain(runs[0]) == 60  # 0.21 >= 0.10 + 0.10
    assert leaderboard_report.time_to_gain(runs[1]) is None  # 0.26 < 0.30
    s = leaderboard_report.summarize(runs)
    assert s["before"] == pytest.approx((0.15, math.sqrt(2 * 0.05**2)))
    assert s["final"] == pytest.approx((0.28, math.sqrt(2 * 0.02**2)))
    assert s["images"] == 1536 and s["train_s"] == pytest.approx(91.5) and s["time_to_gain"] == (60, 1)
    assert s["learns"] is True
    xs, ys = leaderboard_report.mean_curve(runs, "train_s")
    assert xs == pytest.approx([0, 30.5, 61, 91.5]) and ys == pytest.approx([0.15, 0.185, 0.23, 0.28])
    # an algorithm that loses accuracy is listed for diagnosis, never silently left at the bottom
    stuck = _record(0, [(0, 0, 0.042), (30, 512, 0.0)], algorithm="awm")
    # a gain under MIN_GAIN (2 points) is within one evaluation's noise: listed too, although final > start
    noise = _record(0, [(0, 0, 0.10), (30, 512, 0.11)], algorithm="flow_dppo")
    runs[0]["peak_memory_gib"], runs[1]["peak_memory_gib"] = 11.43, 11.84  # GPU records carry it; the row shows the max
    assert leaderboard_report.summarize([noise])["learns"] is False
    for record in (*runs, stuck, noise):
        (tmp_path / f"{record['algorithm']}_{record['seed']}.json").write_text(
            json.dumps(
                record
                | {
                    "device": "cpu",
                    "budget_s": 90,
                    "eval_every_s": 30,
                    "val_prompts": 4,
                    "val_samples_per_prompt": 1,
                    "config": "shapes_quick",
                }
            )
        )
    doc = tmp_path / "doc.md"
    leaderboard_report.write_report(str(tmp_path), str(doc), str(tmp_path))
    text = doc.read_text()
    assert "| dpo | 2 | 15.0 ± 7.1 | 28.0 ± 2.8 | +13.0 | 1536 | 92 | 60 s (1/2 seeds) |" in text
    assert "| 1 | 16.8 | 11.8 |" in text and "| 1 | 17.1 | - |" in text  # peak GiB; "-" for a record without one
    assert "- **flow_dppo**: NO DIAGNOSIS YET" in text
    assert "- **awm**: NO DIAGNOSIS YET" in text and "**dpo**:" not in text.split("did not improve")[1].split("##")[0]
