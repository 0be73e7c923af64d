"""What a run committed to its tables, checked at resume: rows per step against the checkpoint's record, latents and
log-probs against the digests written with each row (diffrl/engines/store/integrity.py)."""

from __future__ import annotations

import shutil

import lance
import pyarrow as pa
import pytest
import torch

from diffrl.engines.store.integrity import DamagedStore, check_digests, check_stored, read_record, write_record
from diffrl.engines.store.synthetic import random_trajectories
from diffrl.engines.store.trajectories import TrajectoryStore

CHUNK = 6  # samples of one chunk: 2 prompts x 3


def _write_step(store: TrajectoryStore, step: int, chunks: int = 2) -> None:
    """`chunks` chunks of step index `step`, then their rewards and advantages, as the stages write them."""
    for chunk in range(chunks):
        traj = random_trajectories(2, 3, seed=10 * step + chunk, prompt_offset=2 * chunk)
        store.append(traj, run="r", step=step, chunk=chunk)
        store.write_rewards(step, traj, torch.rand(CHUNK), {}, torch.ones(CHUNK, dtype=torch.bool))
        store.write_advantages(step, traj, torch.randn(CHUNK))


def _committed(tmp_path, steps: int) -> tuple[TrajectoryStore, str]:
    """A store with `steps` whole steps and the record of the checkpoint after the last one."""
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    previous = None
    for step in range(steps):
        _write_step(store, step)
        folder = tmp_path / f"step_{step + 1}"
        folder.mkdir()
        write_record(str(folder), previous, step, 2 * CHUNK)
        previous = str(folder)
    return store, previous


def test_a_whole_run_passes_and_the_record_grows_by_one_step_per_checkpoint(tmp_path):
    store, checkpoint = _committed(tmp_path, 3)
    assert read_record(checkpoint) == {1: 12, 2: 12, 3: 12}
    check_stored(store, checkpoint, [3])  # the step after the checkpoint has no rows yet


def test_rows_written_by_several_processes_and_a_raced_duplicate_count_once(tmp_path):
    """Engine replicas: each process appends its own chunks of a step through its own handle; a chunk two of them
    raced on is committed twice and counted once."""
    uri = str(tmp_path / "trajectories.lance")
    first, second = TrajectoryStore(uri), TrajectoryStore(uri)
    chunks = [random_trajectories(2, 3, seed=c, prompt_offset=2 * c) for c in range(2)]
    first.append(chunks[0], run="r", step=0, chunk=0)
    second.append(chunks[1], run="r", step=0, chunk=1)
    first._table.append(first._rows(chunks[1], run="r", step=0, chunk=1, write_id="late"))  # the raced loser's rows
    for store, traj in ((first, chunks[0]), (second, chunks[1])):
        store.write_rewards(0, traj, torch.rand(CHUNK), {}, torch.ones(CHUNK, dtype=torch.bool))
        store.write_advantages(0, traj, torch.randn(CHUNK))
    write_record(str(tmp_path), None, 0, 12)
    check_stored(TrajectoryStore(uri), str(tmp_path), [0])


@pytest.mark.parametrize("table", ["trajectories", "rewards", "advantages"])
def test_a_missing_table_is_named_with_the_step_the_checkpoint_records(tmp_path, table):
    store, checkpoint = _committed(tmp_path, 2)
    shutil.rmtree(tmp_path / f"{table}.lance")
    with pytest.raises(
        DamagedStore, match=rf"{table}.lance is missing, yet checkpoint .*step_2 records 12 rows of step 1"
    ):
        check_stored(TrajectoryStore(str(tmp_path / "trajectories.lance")), checkpoint, [])


def test_lost_rows_of_a_checkpointed_step_are_named(tmp_path):
    store, checkpoint = _committed(tmp_path, 2)
    lance.dataset(str(tmp_path / "rewards.lance")).delete("step = 2 AND sample_index = 0")
    with pytest.raises(DamagedStore, match=r"rewards.lance holds 8 rows of step 2 where checkpoint .* records 12"):
        check_stored(store, checkpoint, [])


def test_rewards_of_a_resumed_step_without_their_rows_are_named(tmp_path):
    """Step 3 is in flight (no checkpoint records it): trajectories.lance lost a chunk its rewards were written for."""
    store, checkpoint = _committed(tmp_path, 2)
    _write_step(store, 2)
    lance.dataset(str(tmp_path / "trajectories.lance")).delete("step = 3 AND chunk = 1")
    with pytest.raises(DamagedStore, match=r"trajectories.lance holds 6 rows of step 3 where .*rewards.lance holds 12"):
        check_stored(store, checkpoint, [2])


def test_log_probs_changed_after_they_were_written_are_named(tmp_path):
    store, checkpoint = _committed(tmp_path, 2)
    _write_step(store, 2)
    check_stored(store, checkpoint, [2])
    cast = "arrow_cast(make_array(CAST(0.5 AS FLOAT), CAST(0.5 AS FLOAT)), 'FixedSizeList(2, Float32)')"
    lance.dataset(store.uri).update({"log_probs": cast}, where="step = 3 AND chunk = 1 AND chunk_row = 4")
    with pytest.raises(
        DamagedStore, match=r"the log_probs of step 3 sample \(group_id='uid3', sample_index=1\) differ"
    ):
        check_stored(store, checkpoint, [2])
    check_stored(store, checkpoint, [])  # only the steps a resume trains again are read


def test_latents_that_are_not_the_ones_written_are_named_and_dropped_latents_are_not_checked(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    traj = random_trajectories(2, 3, seed=1)
    rows = store._rows(traj, run="r", step=0, chunk=0, write_id="w")
    altered = traj.latents.clone()
    altered[4, 1, 0, 0, 0] += 1e-3
    latents = pa.ExtensionArray.from_storage(
        rows.schema.field("latents").type,
        pa.FixedSizeListArray.from_arrays(pa.array(altered.reshape(-1).numpy()), altered[0].numel()),
    )
    store._table.append(rows.set_column(rows.schema.get_field_index("latents"), "latents", latents))
    with pytest.raises(DamagedStore, match=r"the latents of step 1 sample \(group_id='uid1', sample_index=1\) differ"):
        check_digests(store, 0)
    assert store.drop_latents(0, 0) == [0]
    check_digests(store, 0)  # no latents left to check; the log-probs still match
