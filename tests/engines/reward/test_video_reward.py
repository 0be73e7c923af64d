"""temporal_consistency against its closed form, alone and with a per-frame image reward in one weighted sum."""

import numpy as np
import pytest

from diffrl.configs.reward import RewardConfig
from diffrl.engines.reward.base import AudioBatch, build_reward
from diffrl.engines.reward.jpeg import jpeg_size_kb
from diffrl.engines.reward.multi import MultiReward


def _ramp(frames: int, step: int) -> np.ndarray:
    """A video (F, 4, 4, 3) whose frame f is the constant f * step."""
    return np.stack([np.full((4, 4, 3), f * step, dtype=np.uint8) for f in range(frames)])


def test_static_alternating_and_ramp_videos_score_their_closed_forms():
    frame = np.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    static = np.stack([frame] * 5)
    alternating = np.stack([np.full((4, 4, 3), 255 * (f % 2), dtype=np.uint8) for f in range(5)])
    videos = np.stack([static, alternating, _ramp(5, 10)])
    out = build_reward("temporal_consistency")(videos, ["a"] * 3, [{}] * 3)
    assert out.scores.tolist() == pytest.approx([1.0, 0.0, 1 - 10 / 255], abs=1e-6)
    assert out.valid.all()
    strided = build_reward("temporal_consistency", {"frame_stride": 2})(videos[2:], ["a"], [{}])
    assert strided.scores.item() == pytest.approx(1 - 20 / 255, abs=1e-6)  # frames 0, 2, 4


def test_images_and_single_frames_are_refused():
    reward = build_reward("temporal_consistency", {"frame_stride": 3})
    with pytest.raises(ValueError, match=r"videos \(B, F, H, W, 3\) with at least 2 frames"):
        reward(np.zeros((1, 4, 4, 3), dtype=np.uint8), ["a"], [{}])
    with pytest.raises(ValueError, match="at least 2 frames at frame_stride 3"):
        reward(np.zeros((1, 3, 4, 4, 3), dtype=np.uint8), ["a"], [{}])


def test_image_reward_per_frame_plus_temporal_term():
    """The documented recipe: an image reward on every frame plus the temporal term, weighted; a video with its
    audio track (AudioBatch) gives both rewards its video."""
    videos = np.stack([_ramp(4, 40), _ramp(4, 5)])
    config = RewardConfig(
        components=[
            {"name": "jpeg_compressibility", "weight": 1.0, "options": {"frame_stride": 1}},
            {"name": "temporal_consistency", "weight": 0.5, "options": {"batch_size": 1}},
        ]
    )
    batch = AudioBatch(np.zeros((2, 1, 800), dtype=np.float32), 1600, video=videos, fps=8.0)
    out = MultiReward(config)(batch, ["a", "b"])
    for i, (video, step) in enumerate(zip(videos, (40, 5))):
        jpeg = -np.mean([jpeg_size_kb(frame) for frame in video]) / 500
        assert out.scores[i].item() == pytest.approx(jpeg + 0.5 * (1 - step / 255), abs=1e-6)
    assert out.info["temporal_consistency"] == pytest.approx([1 - 40 / 255, 1 - 5 / 255], abs=1e-6)
