"""av_sync against its closed form: flashes and clicks at known frames give lag 0, clicks shifted by k frames lag k."""

import math

import numpy as np
import pytest

from diffrl.configs.reward import RewardConfig
from diffrl.engines.reward.av_sync import sync_lag
from diffrl.engines.reward.base import AudioBatch, build_reward
from diffrl.engines.reward.multi import MultiReward

FPS, RATE, FRAMES = 8.0, 800, 16  # 100 audio samples a video frame
FLASHES = (3, 10)


def _flashes(frames=FLASHES) -> np.ndarray:
    """A black video (F, 4, 4, 3) with white frames at `frames`."""
    video = np.zeros((FRAMES, 4, 4, 3), dtype=np.uint8)
    video[list(frames)] = 255
    return video


def _clicks(frames) -> np.ndarray:
    """Silent audio (1, T) with a 10-sample click at the start of each of `frames`."""
    audio = np.zeros((1, FRAMES * RATE // int(FPS)), dtype=np.float32)
    for f in frames:
        audio[0, f * 100 : f * 100 + 10] = 0.8
    return audio


def test_clicks_with_the_flashes_score_1_and_shifted_clicks_give_their_lag():
    shifts = (0, 2, -1, 3)
    waveform = np.stack([_clicks([f + k for f in FLASHES]) for k in shifts])
    batch = AudioBatch(waveform, RATE, video=np.stack([_flashes()] * len(shifts)), fps=FPS)
    out = build_reward("av_sync", {"max_lag_s": 0.5})(batch, ["a"] * 4, [{}] * 4)
    assert out.info["lag_frames"] == list(shifts)
    assert out.info["lag_s"] == pytest.approx([k / FPS for k in shifts])
    assert out.scores.tolist() == pytest.approx([1 - abs(k) / 4 for k in shifts])  # L = 0.5 s * 8 fps = 4 frames


def test_max_lag_is_capped_at_half_the_frames():
    lag, _, max_lag = sync_lag(_flashes(), _clicks([4, 11]), RATE, FPS, max_lag_s=10.0)
    assert (lag, max_lag) == (1, FRAMES // 2)


def test_no_visual_change_or_no_sound_is_excluded_not_zero():
    video = np.stack([np.zeros((FRAMES, 4, 4, 3), dtype=np.uint8), _flashes()])
    waveform = np.stack([_clicks(FLASHES), np.zeros((1, 1600), dtype=np.float32)])
    out = build_reward("av_sync")(AudioBatch(waveform, RATE, video=video, fps=FPS), ["a"] * 2, [{}] * 2)
    assert out.valid.tolist() == [False, False] and all(math.isnan(s) for s in out.scores.tolist())
    assert out.info["error"] == ["no visual change between frames", "no change of audio energy"]
    short = AudioBatch(_clicks(FLASHES)[None, :, :300], RATE, video=_flashes()[None], fps=FPS)
    errors = build_reward("av_sync")(short, ["a"], [{}]).info["error"]
    assert errors == ["3 frames covered by both streams, fewer than 4"]
    with pytest.raises(TypeError, match="audio without video"):
        build_reward("av_sync")(AudioBatch(waveform, RATE), ["a"] * 2, [{}] * 2)


def test_video_with_audio_in_one_weighted_sum():
    """LTX-2's recipe: sync + loudness + temporal term on one AudioBatch, each scoring its stream."""
    config = RewardConfig(
        components=[
            {"name": "av_sync", "weight": 1.0},
            {"name": "audio_loudness", "weight": 0.5, "options": {"target_dbfs": -20.0, "tolerance_db": 100.0}},
            {"name": "temporal_consistency", "weight": 0.25},
        ]
    )
    batch = AudioBatch(np.stack([_clicks([5, 12])]), RATE, video=np.stack([_flashes()]), fps=FPS)
    out = MultiReward(config)(batch, ["a"])
    temporal = 1 - 4 / 15  # four black/white changes among 15 frame pairs
    assert out.scores.item() == pytest.approx((1 - 2 / 4) + 0.5 * 1.0 + 0.25 * temporal, abs=1e-6)
