"""Weighted multi-reward: sums, per-component info, exclusions of non-required components."""

import socket

import numpy as np
import pytest

from diffrl.configs.loader import ConfigError
from diffrl.configs.schema import load_experiment
from diffrl.engines.reward.base import RewardError, build_reward
from diffrl.engines.reward.multi import MultiReward, RewardComponent, RewardConfig, reward_metrics


def _images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.stack([np.full((32, 32, 3), 200, np.uint8), rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)])


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_total_is_the_weighted_sum_of_components():
    images = _images()
    config = RewardConfig(
        components=[
            {"name": "jpeg_compressibility", "weight": 0.5, "options": {"batch_size": 1}},
            {"name": "jpeg_incompressibility", "weight": 2.0, "options": {"quality": 50}},
        ]
    )
    out = MultiReward(config)(images, ["", ""], [{}, {}])
    comp = build_reward("jpeg_compressibility", {})(images, ["", ""], [{}, {}]).scores
    incomp = build_reward("jpeg_incompressibility", {"quality": 50})(images, ["", ""], [{}, {}]).scores
    np.testing.assert_allclose(out.scores.numpy(), (0.5 * comp + 2.0 * incomp).numpy(), rtol=1e-6)
    assert out.info["jpeg_compressibility"] == pytest.approx(comp.tolist())
    assert out.info["excluded"] == [False, False]
    metrics = reward_metrics(out, ["jpeg_compressibility", "jpeg_incompressibility"])
    assert metrics["reward/jpeg_compressibility"] == pytest.approx(comp.mean().item())
    assert metrics["reward/excluded"] == 0


def test_failing_non_required_component_excludes_and_counts():
    config = RewardConfig(
        components=[
            RewardComponent("jpeg_compressibility"),
            RewardComponent(
                "http_scorer", required=False, options={"url": _dead_url(), "retries": 0, "timeout_s": 1.0}
            ),
        ]
    )
    out = MultiReward(config)(_images(), ["", ""], [{}, {}])
    assert out.valid.tolist() == [False, False]
    assert np.isnan(out.scores.numpy()).all()  # never a silent 0
    assert out.info["excluded_by"] == [["http_scorer"], ["http_scorer"]]
    assert "ConnectionError" in out.info["http_scorer/error"][0]
    metrics = reward_metrics(out, ["jpeg_compressibility", "http_scorer"])
    assert metrics["reward/excluded"] == 2
    assert np.isnan(metrics["reward/http_scorer"]) and metrics["reward/jpeg_compressibility"] < 0


def test_failing_required_component_raises_with_its_name():
    config = RewardConfig(components=[RewardComponent("http_scorer", options={"url": _dead_url(), "retries": 0})])
    with pytest.raises(RewardError, match="http_scorer") as caught:
        MultiReward(config)(_images(), ["", ""], [{}, {}])
    assert caught.value.reward_name == "http_scorer"
    config = RewardConfig(components=[RewardComponent("ocr")])
    with pytest.raises(RewardError, match=r"reward 'ocr' failed: ValueError: .*no target text"):
        MultiReward(config)(_images(), ["no quotes", "none"], [{}, {}])


def test_config_checks():
    with pytest.raises(ValueError, match="at least one"):
        RewardConfig(components=[])
    with pytest.raises(ValueError, match="unique.*jpeg_compressibility"):
        RewardConfig(components=[RewardComponent("jpeg_compressibility")] * 2)
    # the settings of the removed reward pool were never read by the flow: now they are unknown keys, not ignored
    with pytest.raises(ConfigError, match=r"unknown config key 'reward.workers'"):
        load_experiment("quickstart", ["reward.workers=2"])
    with pytest.raises(ValueError, match="unknown option"):  # options are validated when built
        MultiReward(RewardConfig(components=[RewardComponent("ocr", options={"lang": "en"})]))
