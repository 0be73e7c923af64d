"""diffrl.registry: the one mechanism behind models, tiny builders, rewards and algorithms."""

import pytest

from diffrl import registry
from diffrl.engines.reward.base import reward_names
from diffrl.models.base import adapter_class, supported_architectures
from diffrl.models.tiny import tiny_architectures


def test_every_kind_lists_its_builtins_through_the_one_registry():
    assert {"sd3", "flux", "qwen_image", "wan", "z_image"} <= set(registry.names("model"))
    assert registry.names("model") == sorted(supported_architectures())
    assert {"sd3", "qwen_image"} <= set(tiny_architectures()) == set(registry.names("tiny"))
    assert {"geneval_lite", "ocr", "jpeg_compressibility"} <= set(reward_names()) == set(registry.names("reward"))
    assert adapter_class("sd3") is registry.get("model", "sd3").obj


def test_an_unknown_name_lists_the_choices_and_the_closest():
    with pytest.raises(ValueError, match=r"unknown model architecture 'sd33' \(did you mean 'sd3'\?\); choose one of"):
        adapter_class("sd33")
    with pytest.raises(ValueError, match=r"unknown reward 'oc'.*'ocr'"):
        registry.get("reward", "oc")


def test_a_second_object_under_a_taken_name_is_refused_and_the_same_one_is_not():
    def first():
        pass

    def second():
        pass

    registry.register("test-kind", "x")(first)
    registry.register("test-kind", "x")(first)  # the same object again: fine
    with pytest.raises(ValueError, match=r"test-kind 'x' is already registered by .*first"):
        registry.register("test-kind", "x")(second)
    assert registry.get("test-kind", "x").obj is first
