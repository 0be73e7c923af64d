"""Janus image-token rollout (TransformersTokenEngine on a JanusImagePolicy) into the token store: the trajectories
carry the image tokens as responses and the decoded images as what the reward scores (streamed to `on_batch` too);
a chunk written to a real Lance table reads back with its images; a table of image-token rows refuses text rows."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from diffrl.configs.schema import load_experiment
from diffrl.engines.reward.multi import MultiReward
from diffrl.engines.rollout.tokens import TokenSampling, TransformersTokenEngine
from diffrl.engines.store.tokens import TokenStore
from diffrl.engines.token_trajectories import TokenTrajectories
from diffrl.models.janus.policy import JanusImagePolicy

# a test config: the tiny random Janus (tests/configs)
JANUS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "janus_shapes_grpo.yaml")


@pytest.fixture(scope="module")
def policy(tiny_model):
    return JanusImagePolicy.from_pretrained(tiny_model("janus"))


def _generate(policy, **kwargs) -> TokenTrajectories:
    return TransformersTokenEngine(policy).generate(
        ["a red circle"] * 2 + ["two squares"] * 2,
        ["g0", "g0", "g1", "g1"],
        [0, 1, 0, 1],
        [7, 8, 9, 10],
        TokenSampling(max_new_tokens=16, batch_size=3),
        policy_version=2,
        metadata=[{"ground_truth": '{"include": [{"count": 1, "shape": "circle", "color": "red"}]}'}] * 4,
        **kwargs,
    )


def test_image_token_rollout_rows_round_trip_with_images(policy, tmp_path):
    streamed = []
    traj = _generate(policy, on_batch=lambda rows, outputs: streamed.append((rows, outputs)))
    assert traj.images.shape == (4, 64, 64, 3) and traj.images.dtype == torch.uint8
    assert traj.outputs is traj.images and traj.lengths.tolist() == [16] * 4
    assert traj.responses == ["<image: 16 tokens>"] * 4
    assert [rows for rows, _ in streamed] == [[0, 1, 2], [3]]
    assert torch.equal(torch.cat([o for _, o in streamed]), traj.images)  # the reward gets images as they come
    # decoded in the rollout's own batches (rows 0-2, then 3): a conv's fp32 rounding depends on the batch on some CPUs
    # (on an AMD EPYC, decoding all 4 at once moved a few pixels by one level)
    ids = torch.stack(traj.response_ids)
    assert torch.equal(torch.cat([policy.decode(ids[:3]), policy.decode(ids[3:])]), traj.images)

    scores = MultiReward(load_experiment(JANUS_CONFIG, []).reward)(traj.outputs, traj.prompts, traj.metadata)
    assert scores.scores.shape == (4,) and bool(scores.valid.all())  # geneval_lite scores the decoded images

    store = TokenStore(str(tmp_path / "trajectories.lance"))
    assert store.append(traj, run="r", step=1, chunk=0)
    back = store.read_chunk(1, 0)
    assert torch.equal(back.images, traj.images)  # PNG is lossless
    assert np.array_equal(np.asarray(store.image(1, "g1", 1)), traj.images[3].numpy())
    assert [r.tolist() for r in back.response_ids] == [r.tolist() for r in traj.response_ids]
    response_ids, log_probs, mask = back.padded()
    with torch.no_grad():
        replay = policy.log_probs(policy.inputs_from_ids(back.prompt_ids, back.image_paths), response_ids)
    torch.testing.assert_close(replay, log_probs, rtol=0, atol=1e-5)
    assert store.read_step(1, with_images=False).images is None  # the update reads no pixels

    text = traj.select([0, 1])
    text.images = None
    with pytest.raises(ValueError, match="holds image-token rows"):
        store.append(text, run="r", step=1, chunk=1)
