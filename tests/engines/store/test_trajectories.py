"""TrajectoryStore on real Lance tables: round trip, idempotency, bad input, rewards, retention."""

import dataclasses
import glob
import os

import pytest
import torch

from diffrl.engines.store.synthetic import random_trajectories
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.engines.trajectories import Trajectories

TENSORS = [
    "latents",
    "log_probs",
    "sigmas",
    "sigmas_prev",
    "trained",
    "images",
    "seeds",
    "sample_index",
    "window_starts",
]


def assert_same(a: Trajectories, b: Trajectories, tensors=TENSORS) -> None:
    for name in tensors:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.prompts == b.prompts and a.group_ids == b.group_ids
    assert a.embed_keys == b.embed_keys and a.metadata == b.metadata


def two_chunks():
    return random_trajectories(2, 3, seed=1), random_trajectories(2, 3, seed=2, prompt_offset=2)


@pytest.mark.parametrize("uri", ["local", "memory://store-test/run/trajectories.lance"])
def test_round_trip_is_exact_and_ordered_by_chunk(tmp_path, uri):
    uri = str(tmp_path / "trajectories.lance") if uri == "local" else uri
    store = TrajectoryStore(uri)
    a, b = two_chunks()
    # Chunk 1 committed before chunk 0: reads still come back in (chunk, row) order.
    assert store.append(b, run="r", step=3, chunk=1)
    assert store.append(a, run="r", step=3, chunk=0)
    assert_same(store.read_step(3), Trajectories.cat([a, b]))
    assert store.steps() == [3] and store.num_rows(3) == 12 and store.committed_chunks(3) == {0, 1}
    assert store.latent_shape() == (3, 4, 8, 8)


def test_shards_partition_the_step(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, b = two_chunks()
    store.append(a, run="r", step=0, chunk=0)
    store.append(b, run="r", step=0, chunk=1)
    full = Trajectories.cat([a, b])
    parts = [store.read_step(0, rank=r, world_size=3) for r in range(3)]
    assert_same(Trajectories.cat(parts), full)
    assert_same(parts[1], full.select(list(range(4, 8))))
    with pytest.raises(ValueError, match="not divisible by world_size=5"):
        store.read_step(0, rank=0, world_size=5)


def test_reappend_is_a_noop(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, _ = two_chunks()
    assert store.append(a, run="r", step=0, chunk=0)
    version = store.version()
    assert not store.append(a, run="r", step=0, chunk=0)
    assert store.version() == version and store.num_rows() == 6


def test_video_round_trip(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    v = random_trajectories(1, 2, num_frames=3, image_size=8, seed=4)
    store.append(v, run="r", step=0, chunk=0)
    assert_same(store.read_step(0), v)
    strip = store.image(0, "uid0", 1)
    assert strip.size == (8, 24)  # (width, height): frames stacked vertically


def test_different_latent_shape_or_dtype_is_rejected_and_touches_nothing(tmp_path):
    uri = str(tmp_path / "trajectories.lance")
    store = TrajectoryStore(uri)
    a, _ = two_chunks()
    store.append(a, run="r", step=0, chunk=0)
    version = store.version()
    other = random_trajectories(1, 2, latent_shape=(4, 8, 16), seed=5, prompt_offset=9)
    with pytest.raises(ValueError, match=r"trajectories.lance.*\(3, 4, 8, 8\).*\(3, 4, 8, 16\)"):
        store.append(other, run="r", step=0, chunk=1)
    double = random_trajectories(1, 2, seed=5, prompt_offset=9)
    double.latents = double.latents.double()
    with pytest.raises(ValueError, match="float32.*float64"):
        store.append(double, run="r", step=1, chunk=0)
    assert store.version() == version
    assert_same(store.read_step(0), a)


def test_sample_stored_in_another_chunk_is_rejected(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, _ = two_chunks()
    store.append(a, run="r", step=0, chunk=0)
    with pytest.raises(ValueError, match="already stored in chunk 0"):
        store.append(a, run="r", step=0, chunk=1)


def test_corrupt_table_names_the_path(tmp_path):
    uri = str(tmp_path / "trajectories.lance")
    TrajectoryStore(uri).append(two_chunks()[0], run="r", step=0, chunk=0)
    for manifest in glob.glob(os.path.join(uri, "_versions", "*")):
        with open(manifest, "wb") as f:
            f.write(b"not a manifest")
    with pytest.raises(ValueError, match="trajectories.lance: cannot read the Lance table"):
        TrajectoryStore(uri)


def test_rewards_and_advantages_align_with_read_order(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, b = two_chunks()
    store.append(a, run="r", step=0, chunk=0)
    store.append(b, run="r", step=0, chunk=1)
    # Chunk 1 is scored first, with keys given in reverse order.
    keys_b = [(0, g, int(i)) for g, i in zip(b.group_ids, b.sample_index)][::-1]
    rb = torch.arange(6, dtype=torch.float32)
    assert store.write_rewards(0, keys_b, rb, {"ocr": rb * 2}, torch.ones(6, dtype=torch.bool)) == 6
    with pytest.raises(ValueError, match="6 of 12 samples of step 0 have no reward"):
        store.read_rewards(0)
    valid_a = torch.tensor([True, True, False, True, True, True])
    ra = torch.tensor([1.0, 2.0, float("nan"), 4.0, 5.0, 6.0])
    store.write_rewards(0, a, ra, {"ocr": ra, "aesthetic": -ra}, valid_a)
    assert store.write_rewards(0, a, ra + 100, {"ocr": ra}, valid_a) == 0  # idempotent: first write wins
    rewards, comps, valid = store.read_rewards(0)
    expected = torch.cat([ra, rb.flip(0)])
    assert torch.equal(rewards, expected) or torch.allclose(rewards, expected, equal_nan=True)
    assert torch.equal(valid, torch.cat([valid_a, torch.ones(6, dtype=torch.bool)]))
    assert torch.allclose(comps["ocr"], torch.cat([ra, rb.flip(0) * 2]), equal_nan=True)
    assert torch.isnan(comps["aesthetic"][6:]).all()
    r1, _, _ = store.read_rewards(0, rank=1, world_size=2)
    assert torch.equal(r1, rb.flip(0))
    adv = torch.linspace(-1, 1, 12)
    store.write_advantages(0, Trajectories.cat([a, b]), adv)
    assert torch.equal(store.read_advantages(0), adv)
    assert torch.equal(store.read_advantages(0, rank=0, world_size=2), adv[:6])


def test_bad_reward_writes(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, _ = two_chunks()
    store.append(a, run="r", step=0, chunk=0)
    ok = torch.ones(6, dtype=torch.bool)
    with pytest.raises(ValueError, match="non-finite"):
        store.write_rewards(0, a, torch.full((6,), float("nan")), {}, ok)
    with pytest.raises(ValueError, match="not in step 0"):
        store.write_rewards(0, [("nope", 0)], torch.ones(1), {}, torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="name steps \\[7\\]"):
        store.write_rewards(0, [(7, "uid0", 0)], torch.ones(1), {}, torch.ones(1, dtype=torch.bool))


def test_retention_drops_old_latents_only(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    chunks = {s: random_trajectories(2, 2, latent_shape=(4, 32, 32), seed=s) for s in range(4)}
    for s, t in chunks.items():
        store.append(t, run="r", step=s, chunk=0)
        store.write_rewards(s, t, torch.arange(4.0), {}, torch.ones(4, dtype=torch.bool))

    def size():
        return sum(
            os.path.getsize(p) for p in glob.glob(str(tmp_path / "**" / "*"), recursive=True) if os.path.isfile(p)
        )

    before = size()
    assert store.drop_latents(keep_latents_steps=2, current_step=3) == [0, 1]
    assert store.drop_latents(keep_latents_steps=2, current_step=3) == []
    with pytest.raises(ValueError, match="latents of step 1 were dropped"):
        store.read_step(1)
    old = store.read_step(0, with_latents=False)
    assert_same(old, chunks[0], tensors=[n for n in TENSORS if n != "latents"])
    assert old.latents.shape == (4, 3, 0)
    assert_same(store.read_step(3), chunks[3])
    assert torch.equal(store.read_rewards(0)[0], torch.arange(4.0))
    store.compact()
    assert store.cleanup(older_than_seconds=0) > 0
    assert size() < before - 2 * 4 * 3 * 4 * 32 * 32 * 4 * 0.9  # two steps' latents are gone
    assert_same(store.read_step(2), chunks[2])
    assert store.num_rows() == 16


def test_read_chunk_returns_that_chunk_only(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, b = two_chunks()
    store.append(a, run="r", step=2, chunk=0)
    store.append(b, run="r", step=2, chunk=1)
    assert_same(store.read_chunk(2, 1), b)
    small = store.read_chunk(2, 0, with_latents=False)
    assert torch.equal(small.images, a.images) and small.latents.shape[-1] == 0
    with pytest.raises(ValueError, match="chunk 5 is not committed"):
        store.read_chunk(2, 5)


def test_retention_on_its_own_handle_while_the_writer_appends(tmp_path):
    """The janitor's retention (diffrl/engines/step/retention.py: drop, merge, delete old versions on a handle of its
    own) runs while the writer appends the next steps: every append commits, every row stays readable, the kept
    steps' latents are exact and the dropped steps' are gone."""
    import threading

    from diffrl.engines.step.retention import _retain_apart

    uri = str(tmp_path / "trajectories.lance")
    writer = TrajectoryStore(uri)
    chunks = {s: random_trajectories(2, 2, latent_shape=(4, 16, 16), seed=s) for s in range(12)}
    for s in range(4):
        writer.append(chunks[s], run="r", step=s, chunk=0)
    failures: list[BaseException] = []
    # As in a run, the retention after step N starts once step N is written (it then overlaps the next appends);
    # unguarded, the janitor could run "after step 7" before steps 4 and 5 existed and leave their latents.
    written = {s: threading.Event() for s in range(12)}
    for s in range(4):
        written[s].set()

    def janitor():
        try:
            for step in (3, 5, 7):  # a rewrite and a merge of the table, three times, while the appends go on
                assert written[step].wait(timeout=120), f"step {step} was not written"
                _retain_apart(TrajectoryStore, uri, None, 2, step, True, 1)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    thread = threading.Thread(target=janitor)
    thread.start()
    for s in range(4, 12):
        writer.append(chunks[s], run="r", step=s, chunk=0)
        writer.write_rewards(s, chunks[s], torch.arange(4.0) + s, {}, torch.ones(4, dtype=torch.bool))
        written[s].set()
    thread.join()
    assert not failures, failures
    assert writer.num_rows() == 12 * 4 and writer.steps() == list(range(12))
    for s in range(6):  # dropped by the last retention (after step 7, two steps kept: 6 and 7)
        assert_same(writer.read_step(s, with_latents=False), chunks[s], tensors=[n for n in TENSORS if n != "latents"])
        with pytest.raises(ValueError, match="were dropped"):
            writer.read_step(s)
    for s in range(6, 12):
        assert_same(writer.read_step(s), chunks[s])
    assert torch.equal(writer.read_rewards(11)[0], torch.arange(4.0) + 11)


def test_image_bytes_is_the_mean_stored_size_of_a_steps_images(tmp_path):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    a, b = two_chunks()
    store.append(a, run="r", step=0, chunk=0)
    store.append(b, run="r", step=0, chunk=1)
    stored = store._table.scan(["image"], filter="step = 1", blobs_as_bytes=True).column("image").to_pylist()
    assert len(stored) == 12 and store.image_bytes(0) == sum(map(len, stored)) / 12  # the PNG bytes written
    assert store.image_bytes(1) is None


def test_every_handle_of_a_table_reads_through_its_bounded_cache(tmp_path):
    """Lance caches the metadata of every version a handle reads, bounded only by its session's size: each handle a
    table opens, appends through or creates (a step commits to it again and again) uses the table's bounded one."""
    import pyarrow as pa

    from diffrl.engines.store.tables import LanceTable

    table = LanceTable(str(tmp_path / "t.lance"))
    for step in range(5):
        table.append(pa.table({"step": [step] * 4}))
        assert table.dataset().session().is_same_as(table._session)
    reopened = LanceTable(table.uri)
    assert reopened.dataset().session().is_same_as(reopened._session) and reopened.version() == 5


def _with_audio(traj: Trajectories, *, frames: bool, seed: int) -> Trajectories:
    """`traj` with stereo waveforms at 8 kHz (a model that makes audio); no frames for an audio-only model."""
    waveform = torch.rand(len(traj), 2, 400, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    waveform[0, 0, :3] = torch.tensor([1.0, -1.0, 0.0])  # full scale both ways, and silence
    images = traj.images if frames else torch.empty((len(traj), 0, 0, 3), dtype=torch.uint8)
    fps = 8.0 if frames else None
    return dataclasses.replace(traj, images=images, audio=waveform, sample_rate=8000, fps=fps)


@pytest.mark.parametrize("frames", [False, True])  # audio only, and video with its audio track
def test_audio_round_trip_as_16_bit_pcm(tmp_path, frames):
    store = TrajectoryStore(str(tmp_path / "trajectories.lance"))
    video = random_trajectories(1, 2, num_frames=3, image_size=8, seed=4)
    a = _with_audio(video, frames=frames, seed=0)
    store.append(a, run="r", step=0, chunk=0)
    back = store.read_step(0)
    assert_same(back, a)  # latents, frames (none for audio only) and the rest exactly
    assert back.sample_rate == 8000 and back.fps == a.fps and back.audio.shape == a.audio.shape
    # round(x * 32768) / 32768, +1.0 clipped to 32767 / 32768
    expected = (a.audio * 32768).round().clamp(-32768, 32767) / 32768
    assert torch.equal(back.audio, expected)
    assert float((back.audio - a.audio).abs().max()) <= 1 / 32768
    outputs = back.outputs
    assert outputs.sample_rate == 8000 and (outputs.video is None) == (not frames)
    assert store.read_step(0, with_images=False).audio is None  # the outputs are read only when asked for
    assert store.image_bytes(0) > 2 * 400 * 2  # a WAV of 2 x 400 16-bit samples and its header, at least
    with pytest.raises(ValueError, match="samples with audio"):  # a chunk without audio does not join the table
        store.append(random_trajectories(1, 2, num_frames=3, image_size=8, seed=5), run="r", step=0, chunk=1)
