"""The audio rule rewards (loudness, silence, spectral centroid) against closed forms, and the AudioBatch contract."""

import math

import numpy as np
import pytest
import torch

from diffrl.engines.reward.audio import SILENCE_FLOOR_DBFS, rms_dbfs, silence_fraction, spectral_centroid
from diffrl.engines.reward.base import AudioBatch, build_reward

RATE = 16000


def _sine(hz: float, seconds: float, amplitude: float = 1.0, channels: int = 1) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return np.stack([amplitude * np.sin(2 * np.pi * hz * t)] * channels).astype(np.float32)


def test_full_scale_sine_is_minus_3_01_dbfs_and_silence_is_the_floor():
    assert rms_dbfs(_sine(1000, 0.1, channels=2)) == pytest.approx(20 * math.log10(math.sqrt(0.5)), abs=1e-4)
    assert rms_dbfs(_sine(1000, 0.1)) == pytest.approx(-3.0103, abs=1e-4)
    assert rms_dbfs(np.zeros((1, 100), dtype=np.float32)) == SILENCE_FLOOR_DBFS


def test_loudness_reward_scores_the_distance_beyond_the_tolerance():
    reward = build_reward("audio_loudness", {"target_dbfs": -20.0, "tolerance_db": 2.0, "falloff_db": 6.0})
    waveform = np.stack([_sine(1000, 0.1, 0.1), _sine(1000, 0.1, 10 ** (-20.5 / 20) * math.sqrt(2))])
    out = reward(AudioBatch(waveform, RATE), ["a", "b"], [{}, {}])
    # 0.1 amplitude: -23.0103 dBFS, 1.0103 dB beyond the tolerance; the second is -20.5 dBFS, inside it
    assert out.scores.tolist() == pytest.approx([math.exp(-1.0103 / 6), 1.0], abs=1e-4)
    assert out.info["rms_dbfs"] == pytest.approx([-23.0103, -20.5], abs=1e-4)


def test_silence_fraction_of_zeros_is_one_and_of_half_a_clip_one_half():
    assert silence_fraction(np.zeros((2, RATE), dtype=np.float32), RATE, 20.0, -60.0) == 1.0
    half = np.concatenate([_sine(440, 1.0, 0.5), np.zeros((1, RATE), dtype=np.float32)], axis=1)
    assert silence_fraction(half, RATE, 20.0, -60.0) == 0.5
    reward = build_reward("audio_silence", {"target_fraction": 0.0, "tolerance": 0.1, "falloff": 0.2})
    out = reward(AudioBatch(np.zeros((1, 1, RATE), dtype=np.float32), RATE), ["a"], [{}])
    assert out.valid.item() and out.scores.item() == pytest.approx(math.exp(-0.9 / 0.2), rel=1e-6)


def test_spectral_centroid_of_a_sine_is_its_frequency_within_one_bin():
    for hz in (440.0, 1234.5, 5000.0):
        assert abs(spectral_centroid(_sine(hz, 0.5, 0.3, channels=2), RATE, 2048) - hz) < RATE / 2048
    reward = build_reward("audio_spectral_centroid", {"target_hz": 1000.0, "tolerance_octaves": 0.5})
    out = reward(AudioBatch(torch.from_numpy(_sine(4000, 0.5)[0])[None], RATE), ["a"], [{}])  # (B, T) torch: mono
    expected = math.exp(-(abs(math.log2(out.info["centroid_hz"][0] / 1000)) - 0.5))  # 2 octaves up: ~exp(-1.5)
    assert out.scores.item() == pytest.approx(expected, rel=1e-6) and expected == pytest.approx(math.exp(-1.5), 1e-2)


def test_unscorable_audio_is_excluded_never_zero():
    bad = np.zeros((3, 1, RATE // 10), dtype=np.float32)
    bad[1, 0, 5] = np.nan
    for name in ("audio_loudness", "audio_silence", "audio_spectral_centroid"):
        out = build_reward(name)(AudioBatch(bad, RATE), ["a"] * 3, [{}] * 3)
        assert out.valid.tolist()[1] is False and math.isnan(out.scores[1].item())
        assert out.info["error"][1] == "non-finite audio samples"
        empty = build_reward(name)(AudioBatch(np.zeros((1, 1, 0), dtype=np.float32), RATE), ["a"], [{}])
        assert not empty.valid.item() and empty.info["error"] == ["empty audio (0 samples)"]
    centroid = build_reward("audio_spectral_centroid")(AudioBatch(bad, RATE), ["a"] * 3, [{}] * 3)
    assert centroid.valid.tolist() == [False, False, False]  # silence has no centroid
    assert centroid.info["error"][0] == "centroid_hz is undefined (no signal energy)"


def test_audio_batch_contract_errors():
    with pytest.raises(TypeError, match="audio_loudness scores audio"):
        build_reward("audio_loudness")(np.zeros((1, 4, 4, 3), dtype=np.uint8), ["a"], [{}])
    with pytest.raises(TypeError, match="audio without video"):
        build_reward("jpeg_compressibility")(AudioBatch(np.zeros((1, 8), dtype=np.float32), RATE), ["a"], [{}])
    with pytest.raises(ValueError, match="needs its fps > 0"):
        AudioBatch(np.zeros((1, 8), dtype=np.float32), RATE, video=np.zeros((1, 2, 4, 4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="sample_rate must be a positive int"):
        AudioBatch(np.zeros((1, 8), dtype=np.float32), 16000.0)
    with pytest.raises(ValueError, match=r"\(B, C, T\) or \(B, T\)"):
        AudioBatch(np.zeros(8, dtype=np.float32), RATE)


def test_audio_batch_slices_both_streams():
    video = np.arange(3 * 2 * 48, dtype=np.uint8).reshape(3, 2, 4, 4, 3)
    batch = AudioBatch(np.arange(12, dtype=np.float32).reshape(3, 4), RATE, video=video, fps=8)
    part = batch[1:3]
    assert len(part) == 2 and part.waveform.shape == (2, 1, 4) and (part.video == video[1:3]).all()
    with pytest.raises(TypeError, match="sliced"):
        batch[0]
