"""Weighted multi-reward: sums, per-component info, exclusions of non-required components."""

import re
import socket

import numpy as np
import pytest
import torch

from diffrl.configs.loader import ConfigError
from diffrl.configs.reward import RewardComponent, RewardConfig
from diffrl.configs.schema import load_experiment
from diffrl.engines.reward.base import RewardError, RewardOutput, build_reward, concat_outputs
from diffrl.engines.reward.multi import MultiReward, combine, drop_partial_components, exclusion_report, reward_metrics


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


def test_a_non_required_component_that_is_down_is_left_out_while_another_remains():
    """An optional reward that is down does not exclude the batch: the total is the other
    components', its scores are NaN and its error says why."""
    down = {"url": _dead_url(), "retries": 0, "timeout_s": 1.0}
    config = RewardConfig(
        components=[
            RewardComponent("jpeg_compressibility"),
            RewardComponent("http_scorer", required=False, options=down),
        ]
    )
    out = MultiReward(config)(_images(), ["", ""], [{}, {}])
    jpeg = build_reward("jpeg_compressibility", {})(_images(), ["", ""], [{}, {}]).scores
    assert out.valid.tolist() == [True, True]
    np.testing.assert_allclose(out.scores.numpy(), jpeg.numpy(), rtol=1e-6)
    assert out.info["excluded_by"] == [[], []] and np.isnan(out.info["http_scorer"]).all()
    error = out.info["http_scorer/error"][0]
    assert error.startswith("down: ") and "Connection refused" in error
    metrics = reward_metrics(out, ["jpeg_compressibility", "http_scorer"])
    assert metrics["reward/excluded"] == 0 and np.isnan(metrics["reward/http_scorer"])


def test_a_batch_with_nothing_scored_names_the_reward_the_count_and_why():
    """With no other component, a down optional reward excludes every sample; so do garbage or NaN answers. The
    error a score stage raises then names the component, the count and the first reason."""
    down = RewardComponent("http_scorer", required=False, options={"url": _dead_url(), "retries": 0})
    reward = MultiReward(RewardConfig(components=[down]))
    out = reward(_images(), ["", ""], [{}, {}])
    assert out.valid.tolist() == [False, False] and out.info["excluded_by"] == [["http_scorer"], ["http_scorer"]]
    error = reward.nothing_scored(out, "step 3 chunk 1")
    assert isinstance(error, RewardError) and error.reward_name == "http_scorer"
    assert re.match(
        r"step 3 chunk 1: 2 of 2 samples excluded by the reward: http_scorer \(not required: it was down and no "
        r"other component remained\) excluded 2 \(error: down: .*Connection\w*Error",
        str(error),
    )


def test_a_non_finite_score_marked_valid_is_excluded_with_its_reason():
    outputs = {"judge": RewardOutput.from_lists([1.0, float("nan")]), "jpeg": RewardOutput.from_lists([0.5, 0.5])}
    out = combine(outputs, {"judge": 1.0, "jpeg": 2.0})
    assert out.valid.tolist() == [True, False] and out.scores[0].item() == 2.0
    assert out.info["excluded_by"] == [[], ["judge"]] and out.info["judge/error"] == ["", "non-finite score nan"]
    assert "judge excluded 1 (error: non-finite score nan)" in exclusion_report(out, ["judge", "jpeg"])


def test_a_component_down_for_part_of_a_step_is_left_out_of_every_total():
    """Chunk 0 had the optional judge, chunk 1 did not: the step's totals drop it everywhere (a group's samples stay
    comparable); with no component left, the step cannot be scored."""
    judge = torch.tensor([1.0, 1.0, float("nan"), float("nan")])
    jpeg = torch.tensor([0.1, 0.2, 0.3, 0.4])
    valid = torch.tensor([True, True, True, False])
    rewards = torch.tensor([1.2, 1.4, 0.6, float("nan")])
    weights = {"jpeg": 2.0, "judge": 1.0}
    total, left_out = drop_partial_components(rewards, {"jpeg": jpeg, "judge": judge}, valid, weights)
    assert left_out == ["judge"] and total[:3].tolist() == pytest.approx([0.2, 0.4, 0.6]) and total[3].isnan()
    same, none = drop_partial_components(rewards[:2], {"jpeg": jpeg[:2], "judge": judge[:2]}, valid[:2], weights)
    assert none == [] and same is rewards[:2] or torch.equal(same, rewards[:2])
    with pytest.raises(RewardError, match="no reward component scored every sample"):
        drop_partial_components(rewards, {"judge": judge}, valid, {"judge": 1.0})


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


def test_batches_whose_info_keys_differ_concatenate():
    """A component down for one streamed batch reports only its error there: the chunk's info still lines up."""
    up = RewardOutput.from_lists([1.0], info={"answer": ["5"]})
    down = RewardOutput.from_lists([None], info={"error": ["down: ConnectionError"]})
    out = concat_outputs([up, down])
    assert out.info == {"answer": ["5", None], "error": [None, "down: ConnectionError"]}
