"""Spawned processes against one trajectory table: concurrent appends and SIGKILL mid-append.

spawn, not fork: Lance's runtime threads do not survive a fork (a forked child hangs).
"""

import glob
import multiprocessing as mp
import os
import signal
import time

import lance
import pyarrow.compute as pc
import torch

from diffrl.engines.store.synthetic import random_trajectories
from diffrl.engines.store.trajectories import TrajectoryStore

CHUNK_PROMPTS, GROUP = 4, 4  # 16 samples per chunk


def chunk_traj(chunk: int, latent_shape=(4, 8, 8)):
    """The deterministic content of (step 0, chunk): what a resumed run regenerates."""
    return random_trajectories(
        CHUNK_PROMPTS, GROUP, latent_shape=latent_shape, seed=100 + chunk, prompt_offset=CHUNK_PROMPTS * chunk
    )


def _append_worker(uri, chunks, latent_shape, results):
    store = TrajectoryStore(uri)
    for chunk in chunks:
        results.put(("start", chunk, None))
        results.put(("done", chunk, store.append(chunk_traj(chunk, latent_shape), run="r", step=0, chunk=chunk)))


def assert_whole_unique_chunks(store, expected_chunks):
    assert store.committed_chunks(0) == set(expected_chunks)
    rows = store.read_step(0, with_latents=False, with_images=False)
    assert len(rows) == CHUNK_PROMPTS * GROUP * len(expected_chunks)
    keys = list(zip(rows.group_ids, rows.sample_index.tolist()))
    assert len(set(keys)) == len(keys)


def test_two_processes_append_concurrently_and_race_on_one_chunk(tmp_path):
    uri = str(tmp_path / "trajectories.lance")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # Both processes also write chunk 8: exactly one commit may win it.
    plans = [[0, 2, 4, 8], [1, 3, 5, 8]]
    procs = [ctx.Process(target=_append_worker, args=(uri, plan, (4, 8, 8), results)) for plan in plans]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    done = []
    while not results.empty():
        kind, chunk, ok = results.get()
        if kind == "done":
            done.append((chunk, ok))
    assert sorted(c for c, ok in done if ok) == [0, 1, 2, 3, 4, 5, 8]
    store = TrajectoryStore(uri)
    assert_whole_unique_chunks(store, [0, 1, 2, 3, 4, 5, 8])
    traj8 = chunk_traj(8)
    got = store.read_step(0)
    assert torch.equal(got.latents[-16:], traj8.latents)


def test_sigkill_mid_append_leaves_whole_chunks_and_resume_completes(tmp_path):
    uri = str(tmp_path / "trajectories.lance")
    big = (3, 64, 64, 32)  # 1.6 MB of latents per sample, 25 MB per chunk
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_append_worker, args=(uri, list(range(6)), big, results))
    child.start()
    while True:  # wait until chunk 2 is about to be written
        kind, chunk, _ = results.get(timeout=120)
        if kind == "start" and chunk == 2:
            break
    # Kill as soon as chunk 2's data file appears, i.e. while Lance is writing it.
    files_before = set(glob.glob(os.path.join(uri, "data", "*")))
    deadline = time.monotonic() + 60
    while set(glob.glob(os.path.join(uri, "data", "*"))) == files_before and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL

    store = TrajectoryStore(uri)
    committed = store.committed_chunks(0)
    assert committed in ({0, 1}, {0, 1, 2})
    assert_whole_unique_chunks(store, sorted(committed))
    ds = lance.dataset(uri)
    referenced = {d.path for f in ds.get_fragments() for d in f.data_files()}
    orphans = [p for p in glob.glob(os.path.join(uri, "data", "*")) if os.path.basename(p) not in referenced]
    print(f"committed {sorted(committed)}; uncommitted data files left by the kill: {len(orphans)}")
    assert orphans or committed == {0, 1, 2}  # the kill landed mid-write (or just after the commit)

    # Resume: the run regenerates every chunk of the step; committed ones are no-ops.
    written = [store.append(chunk_traj(c, big), run="r", step=0, chunk=c) for c in range(6)]
    assert written == [c not in committed for c in range(6)]
    assert_whole_unique_chunks(store, range(6))
    got = store.read_step(0)
    assert torch.equal(got.latents[32:48], chunk_traj(2, big).latents)
    assert pc.all(pc.equal(ds.to_table(columns=["run"]).column("run"), "r")).as_py()


TRIALS = 10


def _create_worker(root, value, barrier, results):
    """TRIALS races, one table each: both workers find no table, then both create it."""
    import pyarrow as pa

    from diffrl.engines.store.tables import LanceTable

    table = pa.table({"x": [value] * 10})
    for trial in range(TRIALS):
        barrier.wait()  # both processes find no table t<trial>, then both create it
        LanceTable(os.path.join(root, f"t{trial}.lance")).append(table)
        results.put((trial, value))


def test_two_processes_creating_one_table_lose_no_rows(tmp_path):
    """Lance's local create is not atomic against another creator: before LanceTable created tables by
    rename, the loser of such a race failed ("Dataset already exists") or, rarely, lost its rows silently.
    Two processes race TRIALS times, on a new table each time (the same two processes: a spawned process
    pays ~2 s of imports, 20 of them were most of this test's 35 s)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_create_worker, args=(str(tmp_path), v, barrier, results)) for v in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    done = sorted(results.get(timeout=10) for _ in range(2 * TRIALS))
    assert done == [(trial, v) for trial in range(TRIALS) for v in (1, 2)]
    for trial in range(TRIALS):
        values = lance.dataset(str(tmp_path / f"t{trial}.lance")).to_table().column("x").to_pylist()
        assert sorted(values) == [1] * 10 + [2] * 10, f"trial {trial}: {len(values)} rows"
        assert not glob.glob(str(tmp_path / f"t{trial}.lance.creating-*"))  # no staging left behind
