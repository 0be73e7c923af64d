"""The asynchronous reward pool: results, back-pressure, failures with chunk ids, spawned
processes. Timing claims (overlap) are measured in benchmarks/reward_ocr.py, not asserted here."""

import numpy as np
import pytest

from diffrl.engines.reward.base import RewardError
from diffrl.engines.reward.multi import MultiReward, RewardComponent, RewardConfig
from diffrl.engines.reward.pool import RewardPool, overlap_length, union


def _chunks(count: int, size: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (size, 16, 16, 3), dtype=np.uint8) for _ in range(count)]


def test_interval_helpers():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert overlap_length([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)


def test_pool_results_equal_direct_scoring_per_chunk():
    config = RewardConfig(components=[RewardComponent("jpeg_compressibility", options={"batch_size": 1})], workers=2)
    chunks = _chunks(5)
    direct = MultiReward(config)
    with RewardPool(config) as pool:
        for chunk_id, images in enumerate(chunks):
            pool.submit(chunk_id, images, ["p"] * len(images))
        results = pool.results()
        stats = pool.overlap_stats()
    assert sorted(results) == list(range(5))
    for chunk_id, images in enumerate(chunks):
        assert results[chunk_id].scores.tolist() == direct(images, ["p"] * len(images)).scores.tolist()
    assert set(stats) == {
        "timing_s/reward",
        "timing_s/reward_wait",
        "timing_s/reward_backpressure",
        "timing_s/reward_overlap",
    }
    assert 0.0 <= stats["timing_s/reward_overlap"] <= 1.0 and stats["timing_s/reward"] > 0


def test_submit_blocks_when_chunks_are_pending(scripted_server):
    server = scripted_server(lambda path, headers, body: (200, {"score": 1.0}, 0.3))
    config = RewardConfig(
        components=[RewardComponent("http_scorer", options={"url": server.url, "concurrency": 1})],
        max_pending_chunks=1,
    )
    with RewardPool(config) as pool:
        for chunk_id, images in enumerate(_chunks(2, size=1)):
            pool.submit(chunk_id, images, ["p"])  # the second waits for the first (~0.3 s)
        assert [out.scores.item() for out in pool.results().values()] == [1.0, 1.0]
        assert pool.overlap_stats()["timing_s/reward_backpressure"] > 0.1


def test_failure_names_the_chunk_and_the_reward(scripted_server):
    # the marker is not hex: a bare b"bad" also matched the multipart body's random hex boundary now and
    # then, failing an "ok" chunk (seen once in a full run)
    server = scripted_server(lambda path, headers, body: (400 if b"fail-me" in body else 200, {"score": 0.5}, 0))
    config = RewardConfig(components=[RewardComponent("http_scorer", options={"url": server.url})], workers=2)
    with RewardPool(config) as pool:
        for chunk_id, prompt in enumerate(["ok", "fail-me", "ok", "fail-me"]):
            pool.submit(chunk_id, _chunks(1, size=1)[0], [prompt])
        with pytest.raises(RewardError, match=r"^chunk 1: reward 'http_scorer': .*HTTP 400"):
            pool.results()
        pool.submit(0, _chunks(1, size=1)[0], ["ok"])  # the pool stays usable after a failure
        assert pool.results()[0].scores.item() == 0.5


def test_duplicate_chunk_id_and_start_up_errors(tmp_path):
    config = RewardConfig(components=[RewardComponent("jpeg_compressibility")])
    with RewardPool(config) as pool:
        pool.submit(7, _chunks(1)[0], ["a", "b"])
        with pytest.raises(ValueError, match="chunk_id 7 was already submitted"):
            pool.submit(7, _chunks(1)[0], ["a", "b"])
        pool.results()
    missing = RewardConfig(components=[RewardComponent("clip_score", options={"model_path": str(tmp_path / "none")})])
    with pytest.raises(ValueError, match="not an existing folder"):
        RewardPool(missing)


def test_spawned_process_workers():
    config = RewardConfig(components=[RewardComponent("jpeg_compressibility")], workers=1, mode="process")
    chunks = _chunks(3)
    with RewardPool(config) as pool:
        for chunk_id, images in enumerate(chunks):
            pool.submit(chunk_id, images, ["p"] * 2, [{}, {}])
        results = pool.results()
    expected = MultiReward(config)
    for chunk_id, images in enumerate(chunks):
        assert results[chunk_id].scores.tolist() == expected(images, ["p"] * 2).scores.tolist()
    bad = RewardConfig(
        components=[RewardComponent("clip_score", options={"model_path": "/no/such/folder"})], mode="process"
    )
    with pytest.raises(ValueError, match="not an existing folder"):  # the worker's build error, verbatim
        RewardPool(bad)
