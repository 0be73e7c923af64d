"""Stored rows are verified as checkpoints are: a table deleted or rolled back, or latents and log-probs changed after
they were written, stop a resume with one line naming what and where, and a checkpoint without its checksums.json is
never loaded (diffrl/engines/store/integrity.py)."""

from __future__ import annotations

import os
import shutil

import lance
import pytest
from e2e_settings import TINY

from diffrl.engines.train.checkpoint import CHECKSUMS
from diffrl.flows.errors import DamagedRun
from diffrl.flows.train import train

RUN = TINY + ["run.steps=2"]  # 2 steps of 8 samples in 2 chunks, checkpoints step_1 and step_2
RUN_DIR = "runs/quickstart"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, diffrl_cache):
    """A finished 2-step run, trained once for the module; each test damages a copy of it."""
    folder = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("DIFFRL_INJECT_FAULT", raising=False)
        train(config=None, overrides=RUN)
    return folder


@pytest.fixture
def run_copy(finished_run, workdir):
    shutil.copytree(finished_run, workdir, dirs_exist_ok=True)
    return workdir


def _newest_manifest(table: str) -> str:
    """The manifest file of the table's latest version (Lance's V1 or V2 file naming)."""
    version = lance.dataset(table).version
    names = {f"{version}.manifest", f"{(1 << 64) - 1 - version:020d}.manifest"}
    [name] = [n for n in os.listdir(f"{table}/_versions") if n in names]
    return f"{table}/_versions/{name}"


@pytest.mark.parametrize(
    "damage, message",
    [
        ("rm rewards.lance", r"rewards.lance is missing, yet checkpoint \S+step_2 records 8 rows of step 1 in it"),
        ("rm trajectories.lance", r"trajectories.lance is missing, yet checkpoint \S+step_2 records 8 rows of step 1"),
        (
            "rm the newest manifest of rewards.lance",
            r"rewards.lance holds 4 rows of step 2 where checkpoint \S+ records 8",
        ),
    ],
)
def test_a_lost_or_rolled_back_table_stops_the_resume_by_name(run_copy, damage, message):
    """These reruns exited 0 and trained step 3 with steps 1-2's rows gone, or half of step 2's rewards missing
    (Lance reads the version before a missing manifest)."""
    table = f"{RUN_DIR}/{damage.split()[-1]}"
    os.remove(_newest_manifest(table)) if "manifest" in damage else shutil.rmtree(table)
    with pytest.raises(DamagedRun, match=rf"run 'quickstart': \S+{message}.*Rerunning cannot repair it"):
        train(config=None, overrides=TINY + ["run.steps=3"])
    assert not os.path.exists(f"{RUN_DIR}/checkpoints/step_3")


def test_a_checkpoint_without_its_checksums_is_never_loaded(run_copy, capsys):
    """It was loaded with a warning only. Now it is treated as unfinished: moved aside, and step 2 is trained again
    from step 1's checkpoint on its stored rows."""
    newest = f"{RUN_DIR}/checkpoints/step_2"
    os.remove(f"{newest}/{CHECKSUMS}")
    assert train(config=None, overrides=RUN)["last_step"] == 2
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged, not loaded: checkpoint file {newest}/{CHECKSUMS} is missing" in err
    assert "resuming after step 1" in err and os.path.isdir(f"{newest}.corrupt")
    assert os.path.exists(f"{newest}/{CHECKSUMS}")


def test_log_probs_changed_in_a_step_being_resumed_stop_the_run(run_copy):
    """Step 2 is trained again (its checkpoint lacks checksums) on stored log-probs changed after they were written:
    they were trained on silently."""
    os.remove(f"{RUN_DIR}/checkpoints/step_2/{CHECKSUMS}")
    table = lance.dataset(f"{RUN_DIR}/trajectories.lance")
    width = table.schema.field("log_probs").type.list_size
    values = ", ".join(["CAST(0.5 AS FLOAT)"] * width)
    table.update(
        {"log_probs": f"arrow_cast(make_array({values}), 'FixedSizeList({width}, Float32)')"},
        where="step = 2 AND chunk_row = 3",
    )
    with pytest.raises(DamagedRun, match=r"the log_probs of step 2 sample \(group_id=.*\) differ from the digest"):
        train(config=None, overrides=RUN)
    assert not os.path.exists(f"{RUN_DIR}/checkpoints/step_2")  # moved aside, and not written again
