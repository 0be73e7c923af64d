"""A run folder written by a diffrl that numbered steps from 0 is refused by name, before any work:
resuming it with steps numbered from 1 would load the wrong checkpoint and label its rows wrongly."""

from __future__ import annotations

import json

from e2e_settings import TINY

from diffrl.flows.cli import main
from diffrl.flows.run_format import check_run_format


def _old_run(workdir):
    """What an older diffrl left after one step: run.json without a format, checkpoints/step_0 and latest.json."""
    run = workdir / "runs" / "quickstart"
    (run / "checkpoints" / "step_0" / "lora").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"uid": "0123456789ab", "mlflow_run_id": "0" * 32}))
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 0, "path": str(run / "checkpoints/step_0")}))
    return run


def test_an_older_run_is_refused_by_train_export_and_evaluate_with_one_line(workdir, capsys):
    run = _old_run(workdir)
    before = sorted(p.relative_to(run) for p in run.rglob("*") if p.name not in ("run.lock", "diffrl.log"))
    for command in (["train", *TINY], ["export", *TINY, "--out", str(workdir / "out")], ["evaluate", *TINY]):
        assert main(command) == 1, command
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"diffrl {command[0]}: error: run 'quickstart'") and "\n" not in err, err
        assert "older diffrl" in err and "numbered steps from 0" in err and "train under a new run.name" in err
    after = sorted(p.relative_to(run) for p in run.rglob("*") if p.name not in ("run.lock", "diffrl.log"))
    assert after == before and json.loads((run / "run.json").read_text()).get("format") is None  # untouched


def test_an_older_run_json_with_nothing_committed_is_taken_over(workdir):
    """A run.json an older diffrl wrote before its run committed anything holds no numbering to misread."""
    run = workdir / "runs" / "quickstart"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"uid": "0123456789ab"}))
    check_run_format(str(run), "quickstart")  # no error
