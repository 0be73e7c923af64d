"""The on-disk format of a run folder, and what happens to a run written by an older diffrl.

Format 2 (runs/<name>/run.json `"format": 2`): steps are numbered from 1 on disk as everywhere else
(diffrl/engines/numbering.py): `checkpoints/step_<k>` holds the weights after k RL steps, `latest.json` and
`trainer_state.json` record k, the Lance tables' `step` column holds k, and rewards.lance / advantages.lance have
`prompt` and `excluded` columns. A run.json without a format was written before: its folders and rows counted steps
from 0 (`step_0` held the weights after the first step), and its reward tables lack those columns. Resuming,
evaluating or exporting such a run is refused with OldRunFormat, before any work: reading it with this numbering
would resume from the wrong checkpoint and mislabel its rows (docs/training.md, "Step numbers").
"""

from __future__ import annotations

from diffrl.engines.store import fs
from diffrl.flows.errors import RunFailure

RUN_FORMAT = 2


class OldRunFormat(RunFailure):
    """The run folder was written by a diffrl that numbered steps from 0."""


def has_stored_data(run_dir: str) -> bool:
    """Whether the run has anything an older numbering could have written: a checkpoint or stored rows."""
    return any(
        fs.exists(fs.join(run_dir, *parts))
        for parts in (("checkpoints", "latest.json"), ("trajectories.lance",), ("rewards.lance",))
    )


def check_run_format(run_dir: str, run_name: str) -> None:
    """OldRunFormat when `run_dir` holds a run written before format 2 (a run.json without it and something
    committed); nothing for a new run, a format-2 run, or an older run.json with nothing committed yet."""
    path = fs.join(run_dir, "run.json")
    if not fs.exists(path):
        return
    found = fs.read_json(path).get("format")
    if found == RUN_FORMAT or (found is None and not has_stored_data(run_dir)):
        return
    raise OldRunFormat(
        f"run {run_name!r} ({run_dir}) was written by an older diffrl (run.json format {found or 1}), which numbered "
        f"steps from 0 (checkpoints/step_0 held the weights after the first step); this one numbers them from 1 and "
        f"cannot resume, evaluate or export it. Finish it with the diffrl that started it, or train under a new "
        f"run.name; its LoRA loads without diffrl: pipe.load_lora_weights('{run_dir}/checkpoints/step_<k>/lora') "
        f"(docs/training.md, 'Step numbers')"
    )
