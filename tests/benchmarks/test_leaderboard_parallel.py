"""The leaderboard's runs several at once (benchmarks/leaderboard_parallel.py): the CPU miniature with
`--parallel 2` (two child processes), a failing child, the probe at miniature size, and the report's handling of
runs made at different concurrency."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import leaderboard, leaderboard_report

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.slow  # 33-99 s on 2 shared cores: two children, each ~20 s of start-up
def test_the_miniature_runs_two_children_at_once_and_reports_their_concurrency(tmp_path):
    out, doc = tmp_path / "runs", tmp_path / "leaderboard.md"
    records = leaderboard.main(["run", "--miniature", "--parallel", "2", "--out-dir", str(out)])
    assert sorted(r["algorithm"] for r in records) == ["diffusion_nft", "flow_grpo"]
    for record in records:
        last = record["history"][-1]
        assert record["finished"] and record["concurrent_runs"] == 2
        assert last["train_s"] >= record["budget_s"]
        assert record["train_images_per_s"] == pytest.approx(last["images"] / last["train_s"])
        assert "--concurrent 2" in record["command"]
        assert 1.5 < record["mean_runs_alongside"] <= 2 + 1e-9  # started together, one ended first
        stem = out / f"{record['algorithm']}_seed0_cpu"
        assert json.loads(stem.with_suffix(".json").read_text()) == json.loads(json.dumps(record))
        assert stem.with_suffix(".log").stat().st_size > 0  # the child's output
    # a second call finds both finished and starts no child
    assert leaderboard.main(["run", "--miniature", "--parallel", "2", "--out-dir", str(out)]) == []

    leaderboard.main(["report", "--results", str(out), "--doc", str(doc), "--images", str(tmp_path)])
    text = doc.read_text()
    assert "Runs at once on the device: 2 " in text and "Warning" not in text
    for record in records:
        row = next(line for line in text.splitlines() if line.startswith(f"| {record['algorithm']} | 1 |"))
        # then the peak GPU memory: "-" for these CPU runs
        assert row.endswith(
            f"| 2 (mean {record['mean_runs_alongside']:.1f}) | {record['train_images_per_s']:.1f} | - |"
        )


def test_a_failing_child_is_recorded_unfinished_and_fails_the_parent(tmp_path):
    # ~6 s: the child fails on its config right after its imports
    argv = ["run", "data.val=null", "--config", "shapes_quick", "--algorithms", "dpo", "--seeds", "3"]
    with pytest.raises(SystemExit) as failed:
        leaderboard.main([*argv, "--parallel", "2", "--out-dir", str(tmp_path)])
    assert "1 of the runs failed: dpo seed 3 (exit code 1)" in str(failed.value.code)
    record = json.loads((tmp_path / "dpo_seed3_cpu.json").read_text())
    assert record["finished"] is False and record["exit_code"] == 1 and record["log"] == "dpo_seed3_cpu.log"
    assert "data.val" in (tmp_path / "dpo_seed3_cpu.log").read_text()  # the child's own error


@pytest.mark.slow  # 29-49 s: one child, then two at once, 2 s of training each
def test_the_probe_measures_each_runs_throughput_alone_and_two_at_once(tmp_path):
    out = tmp_path / "probe.json"
    leaderboard.main(["probe", "--miniature", "--parallel", "1", "2", "--seconds", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["row"] == "flow_grpo" and result["device"] == "cpu" and result["seconds"] == 2
    assert [e["k"] for e in result["by_k"]] == [1, 2] and [len(e["runs"]) for e in result["by_k"]] == [1, 2]
    for entry in result["by_k"]:
        speeds = [r["train_images_per_s"] for r in entry["runs"]]
        assert all(s > 0 for s in speeds)
        for run in entry["runs"]:
            assert run["train_s"] >= 2 and run["train_images_per_s"] == pytest.approx(run["images"] / run["train_s"])
        assert entry["aggregate_images_per_s"] == pytest.approx(sum(speeds))
        assert entry["per_run_vs_solo"] == pytest.approx(entry["per_run_mean"] / result["by_k"][0]["per_run_mean"])
    assert not (tmp_path / "leaderboard").exists()  # the probe's runs went to a temporary folder


def _record(algorithm: str, seed: int, concurrent_runs: int | None) -> dict:
    history = [
        {"step": 0, "train_s": 0.0, "images": 0, "accuracy": 0.1},
        {"step": 4, "train_s": 40.0, "images": 2048, "accuracy": 0.3},
    ]
    record = {"algorithm": algorithm, "seed": seed, "finished": True, "history": history, "device": "NVIDIA H200"}
    record |= {"budget_s": 40, "eval_every_s": 40, "val_prompts": 204, "val_samples_per_prompt": 4, "config": "c"}
    return record if concurrent_runs is None else record | {"concurrent_runs": concurrent_runs}


def _write(folder, records: list[dict]) -> None:
    for r in records:
        (folder / f"{r['algorithm']}_seed{r['seed']}.json").write_text(json.dumps(r))


def test_the_report_flags_runs_made_at_different_concurrency(tmp_path):
    one_k = tmp_path / "one_k"
    one_k.mkdir()
    _write(one_k, [_record("dpo", 0, 3), _record("awm", 0, 3)])
    leaderboard_report.write_report(str(one_k), str(one_k / "doc.md"), str(one_k))
    text = (one_k / "doc.md").read_text()
    assert "Runs at once on the device: 3 " in text and "Warning" not in text
    assert "| dpo | 1 | 10.0 | 30.0 | +20.0 | 2048 | 40 | 40 s (1/1 seeds) | 3 (mean 3.0) | 51.2 |" in text

    # a record of before --parallel counts as one run at a time; a row mixing K is marked, the page warned
    _write(tmp_path, [_record("dpo", 0, None), _record("dpo", 1, 2), _record("awm", 0, 2)])
    summaries = leaderboard_report.write_report(str(tmp_path), str(tmp_path / "doc.md"), str(tmp_path))
    assert summaries["dpo"]["concurrent_runs"] == [1, 2] and summaries["awm"]["concurrent_runs"] == [2]
    text = (tmp_path / "doc.md").read_text()
    assert "Runs at once on the device: MIXED (1, 2)." in text
    assert "**Warning: these runs did not all share the GPU with the same number of runs" in text
    assert "(K=1: dpo seed 0; K=2: dpo seed 1, awm seed 0)" in text
    assert "| 1, 2 (mixed) (mean 1.5) | 51.2 |" in text and text.index("**Warning") < text.index("| algorithm |")


def test_the_leaderboard_page_carries_the_reports_how_it_runs_section():
    # docs/leaderboard.md is hand-written until the first GPU run; `report` then writes the same section
    with open(os.path.join(REPO, "docs", "leaderboard.md")) as f:
        assert leaderboard_report.HOW_IT_RUNS in f.read()
