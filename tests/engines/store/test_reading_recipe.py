"""A run's tables read with plain pylance, as docs/concepts.md ("Reading a run without diffrl") shows: the images
from the blob column (take_blobs), rewards and advantages with their prompt and the excluded samples marked, the
ground truth from the metadata JSON. The tables are written by diffrl's own TrajectoryStore."""

from __future__ import annotations

import dataclasses
import json
import math

import lance
import numpy as np
import torch
from PIL import Image

from diffrl.engines.store.synthetic import random_trajectories
from diffrl.engines.store.trajectories import TrajectoryStore

GENEVAL_TRUTH = json.dumps({"include": [{"count": 2, "class": "circle", "color": "red"}], "tag": "counting"})


def _a_run(run: str) -> tuple:
    """The third step of a run, 2 prompts x 3 samples, in `run`: sample (uid1, 2) excluded by the reward. The store's
    API takes the code's step index (2); its tables hold the step number a person sees (3)."""
    traj = random_trajectories(2, 3, seed=3)
    traj = dataclasses.replace(traj, metadata=[{"ground_truth": GENEVAL_TRUTH, "task": "geneval"}] * len(traj))
    store = TrajectoryStore(f"{run}/trajectories.lance")
    store.append(traj, run="demo", step=2, chunk=0)
    valid = torch.tensor([True, True, True, True, True, False])
    rewards = torch.where(valid, torch.linspace(0.1, 0.6, 6), torch.tensor(float("nan")))
    store.write_rewards(2, traj, rewards, {"geneval_lite": rewards}, valid)
    advantages = torch.where(valid, torch.linspace(-1, 1, 6), torch.tensor(float("nan")))
    store.write_advantages(2, [(g, int(i)) for g, i in zip(traj.group_ids, traj.sample_index)], advantages)
    return traj, rewards


def test_a_run_reads_with_plain_pylance(tmp_path):
    run = str(tmp_path / "runs" / "demo")
    traj, written_rewards = _a_run(run)

    # --- the recipe of docs/concepts.md -------------------------------------------------------------------
    samples = lance.dataset(f"{run}/trajectories.lance")
    rows = samples.to_table(
        columns=["step", "group_id", "sample_index", "prompt", "metadata"], filter="step = 3", with_row_id=True
    )
    images = [Image.open(blob) for blob in samples.take_blobs("image", ids=rows["_rowid"])]
    truth = [json.loads(json.loads(m)["ground_truth"]) for m in rows["metadata"].to_pylist()]
    rewards = lance.dataset(f"{run}/rewards.lance").to_table(filter="step = 3").to_pylist()
    advantages = lance.dataset(f"{run}/advantages.lance").to_table(filter="step = 3").to_pylist()
    # -----------------------------------------------------------------------------------------------------

    assert [np.asarray(image.convert("RGB")).shape for image in images] == [(16, 16, 3)] * 6
    assert np.array_equal(np.asarray(images[0].convert("RGB")), traj.images[0].numpy())  # lossless PNG
    assert truth[0]["include"][0] == {"count": 2, "class": "circle", "color": "red"}
    assert rows["prompt"].to_pylist() == traj.prompts and set(rows["step"].to_pylist()) == {3}
    by_key = {(r["group_id"], r["sample_index"]): r for r in rewards}  # (step, group_id, sample_index): the join key
    assert len(by_key) == 6 and all(r["prompt"] == traj.prompts[0] for r in rewards if r["group_id"] == "uid0")
    excluded = by_key[("uid1", 2)]
    assert excluded["excluded"] and not excluded["valid"] and math.isnan(excluded["reward"])
    assert [r["excluded"] for r in rewards].count(True) == 1
    kept = by_key[("uid0", 0)]
    assert not kept["excluded"] and abs(kept["reward"] - float(written_rewards[0])) < 1e-6
    assert {(a["group_id"], a["sample_index"]) for a in advantages if a["excluded"]} == {("uid1", 2)}
    assert all(math.isnan(a["advantage"]) == a["excluded"] for a in advantages)
    assert {a["prompt"] for a in advantages} == set(traj.prompts)  # looked up in the rows: keys were pairs here
