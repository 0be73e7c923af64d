"""No silently corrupted weights: a checkpoint carries the checksums of its files, `load` checks
them, and a damaged newest checkpoint is reported by path while the run resumes from the one before it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lance
import pytest
from e2e_settings import TINY

from diffrl.engines.train.checkpoint import CHECKSUMS
from diffrl.flows.train import train

# 2 steps, so the newest checkpoint (step 2) has one before it (step 1)
RUN = TINY + ["run.steps=2"]


def _rows_per_step(run_dir: str) -> dict[int, int]:
    steps = lance.dataset(f"{run_dir}/trajectories.lance").to_table(columns=["step"]).column("step").to_pylist()
    return {s: steps.count(s) for s in sorted(set(steps))}


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_run_resumes_from_the_one_before(workdir, capsys, damage):
    """4 KB of 0xFF in the weights (same size: the file still parses, as NaN weights) or a truncated file: the rerun
    names the file, moves the checkpoint aside and trains step 2 again from step 1's checkpoint, on step 2's
    committed rows, to the same weights bit for bit."""
    train(config=None, overrides=RUN)
    newest = Path("runs/quickstart/checkpoints/step_2")
    weights = newest / "trainable.safetensors"
    good = weights.read_bytes()
    assert set(json.loads((newest / CHECKSUMS).read_text())) >= {"trainable.safetensors", "optimizer.safetensors"}
    if damage == "overwrite":
        with open(weights, "r+b") as f:
            f.seek(16384)
            f.write(b"\xff" * 4096)
        assert weights.stat().st_size == len(good)
    else:
        weights.write_bytes(good[: len(good) // 2])
    capsys.readouterr()
    assert train(config=None, overrides=RUN)["last_step"] == 2
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged, not loaded: checkpoint file {weights}" in err
    assert ("truncated" if damage == "truncate" else "does not match its checksum") in err
    assert "resuming after step 1" in err and "steps 2 to 2 are trained again" in err
    assert os.path.isdir(f"{newest}.corrupt")
    assert weights.read_bytes() == good
    assert _rows_per_step("runs/quickstart") == {1: 8, 2: 8}  # step 2's rows were reused, not written again


def test_a_checkpoint_write_cut_short_is_never_loaded(workdir, monkeypatch, capsys):
    """The fault point inside the checkpoint write: step 2's write fails before its third file. Nothing of it is
    committed (its folder is still step_2.tmp), so the rerun resumes after step 1 and writes it whole."""
    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "checkpoint@2.2")
    with pytest.raises(Exception, match="injected fault in stage 'checkpoint' at step 2 chunk 2"):
        train(config=None, overrides=RUN)
    assert os.path.isdir("runs/quickstart/checkpoints/step_2.tmp")
    assert not os.path.exists("runs/quickstart/checkpoints/step_2")
    monkeypatch.delenv("DIFFRL_INJECT_FAULT")
    capsys.readouterr()
    assert train(config=None, overrides=RUN)["last_step"] == 2
    assert "resuming after step 1" in capsys.readouterr().err
    sums = json.loads(open(f"runs/quickstart/checkpoints/step_2/{CHECKSUMS}").read())
    assert len(sums) == 6  # the LoRA export, weights, optimizer state and groups, trainer state, RNG
    assert _rows_per_step("runs/quickstart") == {1: 8, 2: 8}
