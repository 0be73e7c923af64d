"""A user's own Python reward named `module:function` in the config (diffrl/engines/reward/user.py): what it receives
and returns, its options as keyword arguments, its errors in one line, that parsing a config never imports it, and that
a spawned process scores with it. The modules are real files in tests/engines/reward/user_modules."""

from __future__ import annotations

import math
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from diffrl.configs.loader import ConfigError
from diffrl.configs.reward import RewardConfig
from diffrl.configs.schema import load_experiment
from diffrl.engines.reward.base import RewardError, build_reward
from diffrl.engines.reward.multi import MultiReward


def _images(count: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(count, 8, 8, 3), dtype=np.uint8)


def test_a_user_reward_gets_the_batch_and_its_options_as_keyword_arguments(user_reward_modules):
    images = _images()
    reward = build_reward("my_rewards:brightness", {"scale": 2.0})
    out = reward(torch.from_numpy(images), ["a", "b", "c", "d"], [{}] * 4)
    expected = 2.0 * images.reshape(4, -1).astype(np.float64).mean(1) / 255.0
    assert out.valid.all() and np.allclose(out.scores.numpy(), expected, atol=1e-6)


def test_none_excludes_a_sample_and_a_tensor_is_one_score_per_sample(user_reward_modules):
    config = RewardConfig(
        components=[{"name": "my_rewards:every_other"}, {"name": "my_rewards:prompt_length", "weight": 0.5}]
    )
    out = MultiReward(config)(_images(), ["a", "bb", "ccc", "dddd"], [{}] * 4)
    assert out.valid.tolist() == [True, False, True, False]
    assert out.info["my_rewards:prompt_length"] == [1.0, 2.0, 3.0, 4.0]
    assert out.scores[0].item() == pytest.approx(1.0 + 0.5 * 1.0) and math.isnan(out.scores[1].item())
    assert out.info["excluded_by"][1] == ["my_rewards:every_other"]


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_module_for_diffrl:score", r"no module named 'no_such_module_for_diffrl' here; .*PYTHONPATH"),
        ("broken_rewards:score", r"importing 'broken_rewards' failed: No module named 'no_such_dependency_for_diffrl"),
        ("my_rewards:brightnes", r"'my_rewards' has no attribute 'brightnes' \(did you mean 'brightness'\?\)"),
        ("my_rewards:NOT_A_FUNCTION", r"'my_rewards:NOT_A_FUNCTION' is a int, not a function"),
        ("my_rewards:Scorer", r"'my_rewards:Scorer' is a class, not a function"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_one_clear_line_at_start_up(user_reward_modules, name, message):
    with pytest.raises(ValueError, match=message) as error:
        MultiReward(RewardConfig(components=[{"name": name}]))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "function, message",
    [
        ("one_too_many", r"returned 5 scores for 4 samples: one per sample"),
        ("a_mapping", r"returned a dict: it must return one score per sample \(a list, 1-D numpy array or tensor\)"),
        ("words", r"returned a str for sample 0: scores are numbers"),
    ],
)
def test_a_wrong_return_fails_the_batch_naming_the_reward(user_reward_modules, function, message):
    reward = MultiReward(RewardConfig(components=[{"name": f"my_rewards:{function}"}]))
    with pytest.raises(RewardError, match=message) as error:
        reward(_images(), ["a"] * 4, [{}] * 4)
    assert f"reward 'my_rewards:{function}'" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["my_rewards:", ":score", "my-rewards:score", "my_rewards:score:x"])
def test_a_misspelt_module_function_fails_when_the_config_loads(name):
    with pytest.raises(ConfigError, match="a Python reward is named module:function"):
        load_experiment(None, [f"reward.components=[{{name: '{name}'}}]"])


def test_parsing_a_config_never_imports_a_reward_module(user_reward_modules, tmp_path, monkeypatch):
    """Only building the reward (the engines, from the config the user passed) imports its module; a config that is
    only read (a run folder's recorded one, `diffrl config show`) runs nothing."""
    marker = tmp_path / "imports.txt"
    monkeypatch.setenv("DIFFRL_TEST_IMPORT_MARKER", str(marker))
    config = tmp_path / "recorded.yaml"
    config.write_text("base: quickstart\nreward:\n  components:\n    - name: planted_rewards:score\n")
    cfg = load_experiment(str(config))
    assert cfg.reward.components[0].name == "planted_rewards:score"
    assert not marker.exists() and "planted_rewards" not in sys.modules
    build_reward("planted_rewards:score")  # the marker works: building imports it
    assert marker.read_text().count("imported") == 1


def _score_in_child(reward: MultiReward, images: np.ndarray) -> list[float]:
    return reward(images, ["a"] * len(images), [{}] * len(images)).scores.tolist()


def test_a_spawned_process_scores_with_a_user_reward(user_reward_modules):
    """A reward pool in a spawned process gets the MultiReward pickled: the function travels by name and the child
    imports its module from the same path."""
    reward = MultiReward(RewardConfig(components=[{"name": "my_rewards:brightness", "options": {"scale": 3.0}}]))
    images = _images()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        scores = pool.submit(_score_in_child, reward, images).result(timeout=120)
    assert scores == pytest.approx(reward(images, ["a"] * 4, [{}] * 4).scores.tolist())
