"""The reward registry and option validation."""

import pytest

from diffrl.engines.reward.base import build_reward, reward_names


def test_builtin_rewards_are_registered():
    assert {
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "ocr",
        "vlm_judge",
        "clip_score",
        "pickscore",
        "aesthetic",
        "http_scorer",
        "http_audio_scorer",
        "temporal_consistency",
        "audio_loudness",
        "audio_silence",
        "audio_spectral_centroid",
        "av_sync",
    } <= set(reward_names())


def test_unknown_reward_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*jpeg_compressibility.*ocr"):
        build_reward("nope", {})


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'qualty'.*valid options: quality, frame_stride"):
        build_reward("jpeg_compressibility", {"qualty": 90})


def test_string_options_are_converted_and_checked():
    reward = build_reward("jpeg_compressibility", {"quality": "80", "batch_size": "2"})
    assert reward.options.quality == 80 and reward.batch_size == 2
    with pytest.raises(ValueError, match="'quality' of reward 'jpeg_compressibility' must be a int"):
        build_reward("jpeg_compressibility", {"quality": "high"})
    with pytest.raises(ValueError, match="'quality' must be in 1..100"):
        build_reward("jpeg_compressibility", {"quality": 0})


def test_missing_required_option_is_a_value_error():
    with pytest.raises(ValueError, match="bad options for reward 'vlm_judge'.*base_url"):
        build_reward("vlm_judge", {})
