"""Audio features (diffrl.models.causal_lm.audio): the <|audio_pad|> count of a clip against its closed form, features
of a clip independent of the other clips of a batch, and the clips it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.models.causal_lm.audio import audio_features, audio_tokens, feature_extractor


def test_audio_tokens_are_13_per_second_window_plus_the_rest_halved_three_times():
    """Qwen3-Omni's tower: each full window of 2 x n_window = 100 frames (1 s) gives 13 tokens; the rest r frames go
    through three stride-2 convolutions, ceil(ceil(ceil(r / 2) / 2) / 2) = ceil(r / 8) tokens."""
    frames = torch.arange(1, 1001)
    expected = [13 * (f // 100) + math.ceil((f % 100) / 8) for f in frames.tolist()]
    assert audio_tokens(frames, n_window=50).tolist() == expected
    assert audio_tokens(torch.tensor([50, 100]), n_window=50).tolist() == [7, 13]


def test_a_clips_features_do_not_depend_on_its_batch(sine_wav):
    extractor = feature_extractor(128)
    short, long = sine_wav("short.wav", 440, seconds=0.5), sine_wav("long.wav", 880, seconds=1.23)
    alone = audio_features(extractor, [short], n_window=50)
    both = audio_features(extractor, [short, long], n_window=50)
    assert alone["input_features"].shape == (1, 128, 50)  # one frame per 160 samples: 8000 // 160
    assert both["input_features"].shape == (2, 128, 123) and both["feature_attention_mask"].sum(1).tolist() == [50, 123]
    assert torch.equal(both["input_features"][0, :, :50], alone["input_features"][0])
    assert both["input_features"][0, :, 50:].abs().sum() == 0  # padding, masked out
    assert both["audio_tokens"].tolist() == [7, 13 + 3]


def test_clips_at_another_rate_or_too_short_are_refused(sine_wav):
    extractor = feature_extractor(128)
    with pytest.raises(ValueError, match=r"44100 Hz audio; .* takes 16000 Hz and diffrl does not resample: ffmpeg"):
        audio_features(extractor, [sine_wav("cd.wav", 440, rate=44100)], n_window=50)
    with pytest.raises(ValueError, match=r"tick.wav: 160 samples; a clip needs at least 400 \(25 ms\)"):
        audio_features(extractor, [sine_wav("tick.wav", 440, seconds=0.01)], n_window=50)
