"""Every failure of `diffrl train` is one line naming its cause and the file it concerns, says "rerun the same command
to resume" only where a rerun can succeed, and leaves its traceback in runs/<name>/diffrl.log (diffrl/flows/errors.py).

The cases run the command in this process (`main([...])`, as tests/e2e/test_run_format.py does), where the libraries'
own output is not quieted (they were imported and configured before the command), so only diffrl's lines are checked:
the run's `[diffrl]` progress lines, then the failure's one line. The read-only case runs `diffrl train` in a process of
its own and checks all it prints. The out-of-memory case injects torch's OutOfMemoryError (DIFFRL_INJECT_FAULT=...:oom):
a CPU machine cannot run out of GPU memory.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys

import pytest
from e2e_settings import TINY
from test_disk_full import _private_mounts_work
from test_reward_outage import _dead_url

from diffrl.flows.cli import main
from diffrl.flows.train import train

RUN = TINY + ["run.steps=1", "data.num_val_prompts=0"]
RUN_DIR = "runs/quickstart"
LOG = f"{RUN_DIR}/diffrl.log"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, diffrl_cache):
    """A finished 1-step run, trained once for the module; the cases that need one damage a copy of it. What it
    printed is in its console.txt."""
    folder = tmp_path_factory.mktemp("finished")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(printed):
        patch.chdir(folder)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("DIFFRL_INJECT_FAULT", raising=False)
        train(config=None, overrides=RUN)
    (folder / "console.txt").write_text(printed.getvalue())
    return folder


def test_a_run_without_validation_prompts_prints_no_validation_line(finished_run):
    """data.num_val_prompts: 0 validates nothing, so there is no "before training" figure to show."""
    lines = (finished_run / "console.txt").read_text().splitlines()
    assert any(line.startswith("[diffrl] step 1/1: ") for line in lines), lines
    assert not [line for line in lines if "before training" in line or "before -> after" in line], lines


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _damage_data_files(table: str) -> None:
    """Overwrite the middle half of each data file of `table` (a disk or a copy that went wrong)."""
    for name in os.listdir(f"{table}/data"):
        path = f"{table}/data/{name}"
        data = bytearray(open(path, "rb").read())
        data[len(data) // 4 : len(data) // 2] = b"x" * (len(data) // 2 - len(data) // 4)
        open(path, "wb").write(data)


def _damage_mlflow_db() -> None:
    with open("mlflow.db", "r+b") as f:
        f.write(b"z" * 100)  # the SQLite header


# (case, needs the finished run, damage, overrides, exit code, the line's cause (regex), a rerun can succeed)
CASES = [
    (
        "bad YAML override",
        False,
        None,
        ["train.lr=[1,"],
        2,
        r"override 'train.lr=\[1,': the value is not valid YAML \(",
        0,
    ),
    ("invalid seed", False, None, ["run.seed=-1"], 2, r"run.seed must be an integer in \[0, 2\*\*32\), got -1", 0),
    (
        "unreadable latest.json",
        True,
        lambda: _write(f"{RUN_DIR}/checkpoints/latest.json", '{"step": '),
        [],
        1,
        rf"{RUN_DIR}/checkpoints/latest.json is not the checkpoint pointer diffrl writes \(JSONDecodeError",
        0,
    ),
    (
        "latest.json names a missing step",
        True,
        lambda: _write(f"{RUN_DIR}/checkpoints/latest.json", '{"step": 7}'),
        ["run.steps=2"],
        1,
        rf"latest.json names step 7, but {RUN_DIR}/checkpoints/step_7 does not exist",
        0,
    ),
    (
        "damaged Lance data file",
        True,
        lambda: _damage_data_files(f"{RUN_DIR}/trajectories.lance"),
        ["run.steps=2"],
        1,
        rf"{RUN_DIR}/trajectories.lance holds a damaged data file",
        0,
    ),
    (
        # a run without its recorded config.yaml (an older diffrl's): nothing refuses the change before the load
        "checkpoint that does not fit the model",
        True,
        lambda: os.remove(f"{RUN_DIR}/config.yaml"),
        ["run.steps=2", "train.lora_rank=8", "train.lora_alpha=16"],
        2,
        rf"checkpoint {RUN_DIR}/checkpoints/step_1 does not fit the model this config builds \(size mismatch for ",
        0,
    ),
    (
        "damaged mlflow.db",
        True,
        _damage_mlflow_db,
        ["run.steps=2"],
        1,
        r"the MLflow database \S+ is damaged",
        0,
    ),
    ("lr=1e308", False, None, ["train.lr=1e308"], 1, r"step 1: after the update \d+ of the policy's \d+ trainable", 0),
    (
        "reward server down",
        False,
        None,
        [f"reward.components=[{{name: http_scorer, options: {{url: '{_dead_url()}', retries: 0, timeout_s: 5}}}}]"],
        1,
        r"http_scorer: http://127.0.0.1:\d+/score: failed .*Connection refused",
        1,
    ),
    (
        "out of memory",
        False,
        "update_actor@1:oom",
        [],
        1,
        r"out of memory at step 1 \(update_actor\) \(lower train.micro_batch_size, or set "
        r"train.gradient_checkpointing: true\): OutOfMemoryError: CUDA out of memory",
        1,
    ),
]


@pytest.mark.parametrize(
    "needs_run, damage, overrides, code, cause, transient",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_failure_is_one_line_with_its_cause_and_rerun_advice_only_when_a_rerun_can_succeed(
    workdir, finished_run, capfd, monkeypatch, needs_run, damage, overrides, code, cause, transient
):
    if needs_run:
        shutil.copytree(finished_run, workdir, dirs_exist_ok=True)
    if isinstance(damage, str):
        monkeypatch.setenv("DIFFRL_INJECT_FAULT", damage)
    elif damage is not None:
        damage()
    capfd.readouterr()
    assert main(["train", *RUN, *overrides]) == code
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith(("[diffrl] ", "diffrl "))]
    report = [line for line in lines if not line.startswith("[diffrl] ")]
    assert report == lines[-1:] and len(lines) <= 6, "\n".join(lines)  # the run's progress lines, then one line
    [line] = report
    assert line.startswith("diffrl train: error: ") and re.search(cause, line), line
    assert ("rerun the same command" in line) == bool(transient), line
    if code == 1:  # the traceback is in the run's log, which the line names
        assert line.endswith(f"(traceback: {LOG})") and "Traceback" in open(LOG).read(), line


@pytest.mark.skipif(not _private_mounts_work(), reason="needs unshare -rm and bind mounts in a user namespace")
def test_a_read_only_run_folder_is_one_line_naming_the_file(workdir):
    """Mounted read-only in a private mount namespace (root ignores file modes): the run lock cannot be written. Its
    traceback goes to the temporary directory, as the run folder takes none."""
    os.makedirs(RUN_DIR)
    command = " ".join([sys.executable, "-m", "diffrl.flows.cli", "train", *(f"'{a}'" for a in RUN)])
    script = f"mount --bind runs runs && mount -o remount,bind,ro runs && {command}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=workdir, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"diffrl train: error: cannot write {RUN_DIR}/run.lock: Read-only file system"), line
    assert "rerun" not in line and "(traceback: " in line
