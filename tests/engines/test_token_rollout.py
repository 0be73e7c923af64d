"""Token rollout (diffrl.engines.rollout.tokens) into the token trajectory store (diffrl.engines.store.tokens): the
tiny Qwen3-Omni Thinker samples with images; the chunk written to a real Lance table reads back equal to what was
sampled, and the stored log-probs equal the replay of the stored tokens."""

from __future__ import annotations

import lance
import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engines.rollout.tokens import TokenSampling, TransformersTokenEngine
from diffrl.engines.store.tokens import TokenStore
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.models.tiny import build_tiny


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return CausalLMPolicy.from_pretrained(build_tiny("qwen3_omni", str(tmp_path_factory.mktemp("thinker")), seed=0))


def test_rollout_rows_round_trip_and_replay(policy, tmp_path):
    image = str(tmp_path / "scene.png")
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image)
    engine = TransformersTokenEngine(policy)
    sampling = TokenSampling(max_new_tokens=5, batch_size=3)
    meta = [{"images": [image], "ground_truth": "2"}] * 2 + [{"ground_truth": "x"}] * 2
    traj = engine.generate(
        ["how many circles?"] * 2 + ["a red square"] * 2,
        ["q1", "q1", "q0", "q0"],
        [0, 1, 0, 1],
        [7, 8, 9, 10],
        sampling,
        policy_version=3,
        metadata=meta,
    )
    assert len(traj) == 4 and traj.policy_version == 3 and traj.image_paths == [(image,), (image,), (), ()]
    assert all(1 <= n <= 5 for n in traj.lengths.tolist())
    assert traj.responses == policy.tokenizer.batch_decode(traj.response_ids, skip_special_tokens=True)

    store = TokenStore(str(tmp_path / "trajectories.lance"))
    assert store.append(traj, run="r", step=4, chunk=0) and not store.append(traj, run="r", step=4, chunk=0)
    back = store.read_chunk(4, 0)
    assert back.group_ids == traj.group_ids and back.metadata == traj.metadata and back.responses == traj.responses
    for a, b in zip(back.response_ids + back.prompt_ids, traj.response_ids + traj.prompt_ids):
        assert a.tolist() == b.tolist()
    for a, b in zip(back.log_probs, traj.log_probs):
        torch.testing.assert_close(a, b)
    # rewards and advantages key on the token rows as on diffusion rows
    store.write_rewards(4, back, torch.tensor([1.0, 0.0, 0.5, 0.5]), {}, torch.ones(4, dtype=torch.bool))
    assert store.read_rewards(4)[0].tolist() == [1.0, 0.0, 0.5, 0.5]

    # replay of the stored rows from their ids and image paths: the rollout's log-probs
    response_ids, log_probs, mask = back.padded()
    with torch.no_grad():
        replay = policy.log_probs(policy.inputs_from_ids(back.prompt_ids, back.image_paths), response_ids)
    torch.testing.assert_close(replay * mask, log_probs, rtol=0, atol=1e-5)


def test_greedy_sampling_is_deterministic(policy):
    engine = TransformersTokenEngine(policy)
    greedy = TokenSampling(max_new_tokens=4, temperature=0.0)
    a = engine.generate(["hello"] * 2, ["g", "g"], [0, 1], [1, 2], greedy)
    b = engine.generate(["hello"] * 2, ["g", "g"], [0, 1], [3, 4], greedy)
    assert [r.tolist() for r in a.response_ids] == [r.tolist() for r in b.response_ids]
    assert a.response_ids[0].tolist() == a.response_ids[1].tolist()


def test_audio_rows_store_their_clips_by_path_and_replay(policy, tmp_path, sine_wav):
    """Audio prompts through the rollout engine into Lance: the rows hold the clips' paths (never a waveform) and the
    stored ids and paths replay to the stored log-probs."""
    clips = [sine_wav("a.wav", 440), sine_wav("b.wav", 1000, seconds=0.7)]
    engine = TransformersTokenEngine(policy)
    meta = [{"audios": [clips[0]], "ground_truth": "a"}] * 2 + [{"audios": clips, "ground_truth": "b"}] * 2
    traj = engine.generate(
        ["what do you hear?"] * 2 + ["which is higher?"] * 2,
        ["q0", "q0", "q1", "q1"],
        [0, 1, 0, 1],
        [3, 4, 5, 6],
        TokenSampling(max_new_tokens=4, batch_size=3),  # the second prompt's rows split over two generate calls
        metadata=meta,
    )
    assert traj.audio_paths == [(clips[0],)] * 2 + [tuple(clips)] * 2 and traj.image_paths == [()] * 4

    store = TokenStore(str(tmp_path / "trajectories.lance"))
    assert store.append(traj, run="r", step=1, chunk=0)
    table = lance.dataset(str(tmp_path / "trajectories.lance")).to_table()
    assert table.column("audios").to_pylist() == [[clips[0]]] * 2 + [clips] * 2
    assert table.nbytes < 8_000  # 4 rows of ids, log-probs and paths: no waveform or feature in them
    back = store.read_chunk(1, 0)
    assert back.audio_paths == traj.audio_paths and back.select([3]).audio_paths == [tuple(clips)]
    response_ids, log_probs, mask = back.padded()
    with torch.no_grad():
        inputs = policy.inputs_from_ids(back.prompt_ids, back.image_paths, back.audio_paths)
        replay = policy.log_probs(inputs, response_ids)
    torch.testing.assert_close(replay * mask, log_probs, rtol=0, atol=1e-5)
