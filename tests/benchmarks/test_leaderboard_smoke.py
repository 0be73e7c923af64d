"""The algorithm leaderboard's harness (benchmarks/leaderboard.py): its CPU miniature -- two rows, one seed,
seconds of training each on the CPU shapes model -- run and reported as the GPU leaderboard is; the asynchronous
miniature -- the on-policy flow_grpo row beside its one-step-off row, at equal images -- and its comparison; and the
report's statistics against their closed forms on hand-written records."""

from __future__ import annotations

import json
import math
import os

import pytest
from PIL import Image

from benchmarks import leaderboard, leaderboard_report
from benchmarks.leaderboard_parallel import run_order
from benchmarks.leaderboard_rows import REPO, Plan
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


@pytest.mark.slow  # ~35 s on 2 cores
def test_the_async_miniature_trains_one_step_off_beside_on_policy_at_equal_images(tmp_path):
    out, doc = tmp_path / "runs", tmp_path / "leaderboard.md"
    argv = ["run", "--miniature", "--algorithms", "flow_grpo", "flow_grpo_async1", "--budget-images", "16"]
    records = leaderboard.main([*argv, "--out-dir", str(out)])
    assert [r["algorithm"] for r in records] == ["flow_grpo", "flow_grpo_async1"]
    on_policy, one_off = records
    for record in records:  # 8 images a step: two steps each, evaluated before and at the budget
        assert record["finished"] and record["budget_images"] == 16 and record["eval_every_images"] == 16
        assert [(e["step"], e["images"]) for e in record["history"]] == [(0, 0), (2, 16)]
        assert "--budget-images 16 --eval-every-images 16" in record["command"]
    assert on_policy["max_staleness"] == 0 and "staleness_max" not in on_policy  # the synchronous step logs no async/*
    # step 1 trains what version 0 sampled beside nothing; step 2 what version 0 sampled beside step 1's update
    assert one_off["max_staleness"] == 1 and one_off["staleness_max"] == 1 and one_off["async_dropped"] == 0
    assert {"run.async.max_staleness=1", "train.rollout_correction=tis"} <= set(one_off["overrides"])

    leaderboard.main(
        ["report", "--results", str(out), "--async-results", str(out), "--doc", str(doc)] + ["--images", str(tmp_path)]
    )
    text = doc.read_text()
    assert "Budget: 16 images per run, evaluated every 16 images" in text
    section = text.split("## Asynchronous rows")[1].split("## How it runs")[0]
    final = [100 * r["history"][-1]["accuracy"] for r in records]
    difference = final[1] - final[0]
    assert (
        f"| flow_grpo_async1 | 1 | 1 | 1 | 16 (on-policy 16) | {final[1]:.1f} | {final[0]:.1f} | {difference:+.1f} "
        "| n/a (one on-policy seed) |" in section
    )
    assert "- **flow_grpo_async1**: the flow_grpo row with the next step's rollout beside the update" in text


@pytest.mark.slow  # ~60 s on 2 cores
def test_the_distillation_row_trains_its_teacher_first_then_reuses_it(tmp_path):
    out = tmp_path / "runs"
    argv = ["run", "--miniature", "--algorithms", "diffusion_opd", "--budget-images", "16", "--out-dir", str(out)]
    (record,) = leaderboard.main(argv)
    # a fresh out-dir has no teacher: the flow_grpo row of this seed trains first, for the same budget
    folder = out / "teachers" / "flow_grpo_seed0"
    teacher_run = json.loads((folder / "flow_grpo_seed0_cpu.json").read_text())
    assert teacher_run["finished"] and [e["images"] for e in teacher_run["history"]] == [0, 16]
    lora = folder / "pytorch_lora_weights.safetensors"
    assert record["finished"] and [e["images"] for e in record["history"]] == [0, 16]
    accuracy = [teacher_run["history"][0]["accuracy"], teacher_run["history"][-1]["accuracy"]]
    expected = {"row": "flow_grpo", "model": "reference:shapes-small", "lora": str(lora), "accuracy": accuracy}
    assert record["teacher"] == {**expected, "record": "flow_grpo_seed0_cpu.json"}
    # the teacher run is no row of the report (its records are the folder's top level only)
    assert sorted(leaderboard_report.load_runs(str(out))) == ["diffusion_opd"]
    # the next run of the row distils the same teacher without training it again
    written = lora.stat().st_mtime_ns
    (out / "diffusion_opd_seed0_cpu.json").unlink()
    (again,) = leaderboard.main(argv)
    assert again["teacher"] == record["teacher"] and lora.stat().st_mtime_ns == written


def test_async_rows_compare_with_the_on_policy_spread_and_the_doc_carries_their_section(tmp_path):
    on_policy = [_record(s, [(0, 0, 0.06), (30, 512, a)], "flow_grpo") for s, a in ((0, 0.20), (1, 0.24), (2, 0.22))]
    one_off = [_record(s, [(0, 0, 0.06), (31, 512, a)], "flow_grpo_async1") for s, a in ((0, 0.21), (1, 0.23))]
    two_off = [_record(0, [(0, 0, 0.06), (29, 512, 0.19)], "flow_grpo_async2")]
    for record in one_off:
        record |= {"max_staleness": 1, "staleness_max": 1.0}
    two_off[0] |= {"max_staleness": 2, "staleness_max": 1.0}  # the local pipeline runs one step ahead at most
    for record in on_policy + one_off + two_off:
        record["device"] = "NVIDIA H100 80GB HBM3"
    runs = {"flow_grpo": on_policy, "flow_grpo_async1": one_off, "flow_grpo_async2": two_off}
    first, second = leaderboard_report.async_comparison(runs)
    # on-policy: mean 0.22, sample s.d. 0.02; one off: mean 0.22 (within); two off: 0.19, 3 points below (outside)
    assert first["row"] == "flow_grpo_async1" and first["on_policy_final"] == pytest.approx((0.22, 0.02))
    assert first["final"] == pytest.approx((0.22, math.sqrt(2 * 0.01**2))) and first["within"] is True
    assert second["difference"] == pytest.approx(-0.03) and second["within"] is False
    assert (second["max_staleness"], second["staleness_max"]) == ([2], 1.0)
    # with one on-policy seed there is no spread to be within
    assert leaderboard_report.async_comparison({**runs, "flow_grpo": on_policy[:1]})[0]["within"] is None
    assert leaderboard_report.async_comparison({"flow_grpo_async1": one_off}) == []  # nothing to compare with
    lines = leaderboard_report.async_section(runs)
    row = "| flow_grpo_async2 | 2 | 1 | 1 | 512 (on-policy 512) | 19.0 | 22.0 ± 2.0 | -3.0 | no | NVIDIA H100 80GB HBM3"
    assert row + " |" in lines
    # docs/leaderboard.md is regenerated from the records: it carries the section's text
    with open(os.path.join(REPO, "docs", "leaderboard.md")) as f:
        assert leaderboard_report.ASYNC_TEXT in f.read()


def test_an_images_budget_reaches_the_parallel_children():
    plan = Plan("c", ("flow_grpo", "flow_grpo_async2"), (0,), 300.0, 30.0, ("x=1",), 25600, 5120)
    assert [r.name for r in plan.rows()] == ["flow_grpo", "flow_grpo_async2"]
    argv = plan.child_argv(plan.rows()[1], 2, "/out", 9)
    assert argv[argv.index("--algorithms") + 1] == "flow_grpo_async2"
    assert argv[-4:] == ["--budget-images", "25600", "--eval-every-images", "5120"]
    assert "--budget-images" not in Plan("c", ("flow_grpo",), (0,), 300.0, 30.0, ()).child_argv(
        plan.rows()[0], 0, "/o", 1
    )


def test_runs_start_seed_by_seed_or_row_by_row_in_the_named_order():
    plan = Plan("c", ("gardo", "dgpo"), (0, 1), 300.0, 60.0, ())
    by_seed = [(r.name, s) for r, s in run_order(plan, by_row=False)]
    assert by_seed == [("dgpo", 0), ("gardo", 0), ("dgpo", 1), ("gardo", 1)]  # the table's row order
    by_row = [(r.name, s) for r, s in run_order(plan, by_row=True)]
    assert by_row == [("gardo", 0), ("gardo", 1), ("dgpo", 0), ("dgpo", 1)]  # --algorithms order


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


def test_every_rows_overrides_make_a_config_the_run_accepts():
    """Each row's overrides on the GPU base config load (no unknown key or bad value) and pass the checks a run makes
    before any work; a distilling row with its teacher set as the runner sets it."""
    from benchmarks.leaderboard_rows import ALL_ROWS, GPU_CONFIG
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.build_preference import check_preference_config

    distils = ["model.teacher=reference:shapes", "model.teacher_lora=teacher.safetensors"]
    for row in ALL_ROWS:
        teacher = distils if row.teacher is not None else []
        cfg = load_experiment(GPU_CONFIG, [*row.overrides, *teacher, "run.seed=1"])
        check_preference_config(cfg)
        assert cfg.algorithm.name in row.name, row.name
        assert cfg.rollout.samples_per_step == 512, row.name  # every row sees 512 images a step


def test_rows_from_another_device_get_their_own_section_with_the_runs_that_failed(tmp_path):
    main, other = tmp_path / "main", tmp_path / "other"
    main.mkdir(), other.mkdir()
    common = {"budget_s": 90, "val_prompts": 4, "val_samples_per_prompt": 1, "config": "shapes_quick"}
    main_record = _record(0, [(0, 0, 0.1), (90, 512, 0.2)]) | common | {"device": "A", "eval_every_s": 30}
    (main / "dpo_0.json").write_text(json.dumps(main_record))
    # the flow_grpo baseline is evaluated at the start and the end only; the rows every 30 s
    teacher = _record(0, [(0, 0, 0.10), (90, 512, 0.30)], algorithm="flow_grpo") | {"eval_every_s": 90}
    row = _record(0, [(0, 0, 0.10), (30, 256, 0.14), (60, 384, 0.22)], algorithm="dgpo") | {"eval_every_s": 30}
    for record in (teacher, row):
        name = f"{record['algorithm']}_seed0_b.json"
        (other / name).write_text(json.dumps(record | common | {"device": "B", "concurrent_runs": 6}))
    (other / "gardo_seed0_b.log").write_text("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED\n")
    (other / "dgpo_seed0_b.log").write_text("a finished run's log\n")
    doc = tmp_path / "doc.md"
    # a second call: its own flow_grpo runs, under the same file names as the first call's
    second = tmp_path / "second"
    second.mkdir()
    again = _record(0, [(0, 0, 0.10), (30, 256, 0.12), (60, 512, 0.25)], algorithm="flow_grpo") | {"eval_every_s": 30}
    ema = _record(0, [(0, 0, 0.10), (30, 256, 0.21), (60, 512, 0.24)], algorithm="flow_grpo_ema_ref")
    for record in (again, ema | {"eval_every_s": 30}):
        name = f"{record['algorithm']}_seed0_b.json"
        (second / name).write_text(json.dumps(record | common | {"device": "B", "concurrent_runs": 2}))
    leaderboard_report.write_report(str(main), str(doc), str(tmp_path), other_device_dirs=[str(other), str(second)])
    section = doc.read_text().split("## Rows measured on another device")[1].split("## How it runs")[0]
    first_call, second_call = section.split("### `benchmarks/results/other/`")[1].split(
        "### `benchmarks/results/second/`"
    )
    budget = "Budget: 90 s of training per run, evaluated every 30 s. Runs at once on the device: 6."
    assert f"Device: B. {budget}" in first_call
    assert "| flow_grpo | 1 | 10.0 | 30.0 | +20.0 | 512 | 90 | 90 s (1/1 seeds) |" in first_call
    assert "| dgpo | 1 | 10.0 | 22.0 | +12.0 | 384 | 60 | 60 s (1/1 seeds) |" in first_call
    assert "Runs that failed to start (their logs): gardo_seed0_b." in first_call
    assert "Runs at once on the device: 2." in second_call and "failed" not in second_call
    assert "| flow_grpo | 1 | 10.0 | 25.0 | +15.0 | 512 | 60 | 60 s (1/1 seeds) |" in second_call
    assert "| flow_grpo_ema_ref | 1 | 10.0 | 24.0 | +14.0 | 512 | 60 | 30 s (1/1 seeds) |" in second_call
    settings = doc.read_text().split("## Settings of each row")[1]
    assert "- **dgpo**:" in settings and "- **flow_grpo_ema_ref**:" in settings  # their settings are listed too
    leaderboard_report.write_report(str(main), str(doc), str(tmp_path), other_device_dirs=[str(tmp_path / "none")])
    assert "## Rows measured on another device" not in doc.read_text()
