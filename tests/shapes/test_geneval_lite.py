"""geneval_lite: exact renders score 1, near-misses get the hand-computed partial credit."""

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffrl.engines.reward.base import build_reward, reward_names
from diffrl.shapes.geneval_lite import (
    Detection,
    GenevalLiteOptions,
    color_masks,
    detect,
    detect_batch,
    relation_holds,
)
from diffrl.shapes.scenes import SceneObject, render, scene_pairs, target_json


def _score(objects, target, transform=None):
    image = render(objects)
    if transform is not None:
        image = transform(image)
    out = build_reward("geneval_lite")(image[None], ["p"], [{"ground_truth": target_json(target)}])
    assert out.valid.all() and out.scores.dtype == torch.float32
    return out.scores[0].item(), out.info["accuracy"][0]


def _blur(image):
    return np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(1.0)))


def _noise(image):
    noisy = image + np.random.default_rng(0).normal(0, 10, image.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


THREE_CIRCLES = {"tag": "counting", "include": [{"shape": "circle", "count": 3}]}
BLUE_SQUARE = {"tag": "colors", "include": [{"shape": "square", "count": 1, "color": "blue"}]}
CIRCLE_LEFT_OF_SQUARE = {
    "tag": "position",
    "include": [{"shape": "square", "count": 1}, {"shape": "circle", "count": 1, "position": ["left of", 0]}],
}
RED_CIRCLE_AND_GREEN_TRIANGLE = {
    "tag": "color_attr",
    "include": [{"shape": "circle", "count": 1, "color": "red"}, {"shape": "triangle", "count": 1, "color": "green"}],
}


def test_registered_and_exact_renders_of_every_category_score_one():
    assert "geneval_lite" in reward_names()
    images, prompts, targets = scene_pairs(240, seed=11)
    out = build_reward("geneval_lite")(
        torch.from_numpy(images), prompts, [{"ground_truth": target_json(t)} for t in targets]
    )
    assert torch.equal(out.scores, torch.ones(240)) and out.info["accuracy"] == [1.0] * 240
    assert len(out.info["detected"]) == 240 and "@" in out.info["detected"][0]


@pytest.mark.parametrize("transform", [None, _blur, _noise], ids=["exact", "blur", "noise"])
def test_counting_near_misses(transform):
    at = [(12, 12), (32, 32), (52, 52), (12, 52)]
    circles = [SceneObject("circle", "red", x, y, 14) for x, y in at]
    assert _score(circles[:3], THREE_CIRCLES, transform) == (1.0, 1.0)
    assert _score(circles[:2], THREE_CIRCLES, transform) == (pytest.approx(1 - 1 / 3), 0.0)  # 1 - |3-2|/3
    assert _score(circles, THREE_CIRCLES, transform) == (pytest.approx(1 - 1 / 3), 0.0)  # 1 - |3-4|/3
    assert _score(circles[:1], THREE_CIRCLES, transform) == (pytest.approx(1 / 3), 0.0)
    squares = [SceneObject("square", "red", x, y, 14) for x, y in at[:3]]
    assert _score(squares, THREE_CIRCLES, transform) == (0.0, 0.0)  # wrong shape: no circle found


@pytest.mark.parametrize("transform", [None, _blur, _noise], ids=["exact", "blur", "noise"])
def test_colour_near_misses(transform):
    assert _score([SceneObject("square", "blue", 30, 30, 16)], BLUE_SQUARE, transform) == (1.0, 1.0)
    # Right shape, wrong colour: count term 1, colour term 0.
    assert _score([SceneObject("square", "red", 30, 30, 16)], BLUE_SQUARE, transform) == (0.5, 0.0)
    # Two red circle / green triangle pairs with one colour wrong: terms 1, 1, 1, 0.
    wrong = [SceneObject("circle", "red", 16, 30, 16), SceneObject("triangle", "yellow", 46, 30, 16)]
    assert _score(wrong, RED_CIRCLE_AND_GREEN_TRIANGLE, transform) == (0.75, 0.0)


@pytest.mark.parametrize("transform", [None, _blur, _noise], ids=["exact", "blur", "noise"])
def test_position_near_misses(transform):
    left = [SceneObject("circle", "blue", 14, 32, 16), SceneObject("square", "yellow", 48, 34, 16)]
    assert _score(left, CIRCLE_LEFT_OF_SQUARE, transform) == (1.0, 1.0)
    swapped = [SceneObject("circle", "blue", 48, 32, 16), SceneObject("square", "yellow", 14, 34, 16)]
    assert _score(swapped, CIRCLE_LEFT_OF_SQUARE, transform) == (pytest.approx(2 / 3), 0.0)  # terms 1, 1, 0
    stacked = [SceneObject("circle", "blue", 32, 14, 16), SceneObject("square", "yellow", 32, 48, 16)]
    assert _score(stacked, CIRCLE_LEFT_OF_SQUARE, transform) == (pytest.approx(2 / 3), 0.0)  # above, not left
    # The square is missing: count terms 1 and 0, no reference for the relation.
    assert _score(left[:1], CIRCLE_LEFT_OF_SQUARE, transform) == (pytest.approx(1 / 3), 0.0)


def test_batched_detection_equals_one_image_at_a_time():
    """The batch labels components of all images at once: objects at the bottom edge of one image and the
    top edge of the next stay apart, and every image's detections and colour masks equal its own pass."""
    images, _, _ = scene_pairs(40, seed=5)
    edge = [render([SceneObject("square", "red", 32, 59, 12)]), render([SceneObject("square", "red", 32, 4, 12)])]
    noisy = np.clip(images + np.random.default_rng(1).normal(0, 40, images.shape), 0, 255).astype(np.uint8)
    batch = np.concatenate([np.stack(edge), images, noisy])
    options = GenevalLiteOptions()
    found = detect_batch(batch, options)
    assert found == [detect(image, options) for image in batch]
    assert [len(f) for f in found[:2]] == [1, 1] and found[0][0].cy > 50 and found[1][0].cy < 14
    assert sum(len(f) for f in found[2:42]) >= 40  # every scene has at least one object
    masks = color_masks(batch[2], options)
    assert sum(int(m.sum()) for m in masks.values()) > 0 and not (masks["red"] & masks["blue"]).any()


def test_blank_image_and_speckles_score_zero():
    blank = render([])
    assert _score([], BLUE_SQUARE) == (0.0, 0.0)
    speckled = blank.copy()
    speckled[10:13, 10:13] = (30, 70, 220)  # 9 blue pixels < min_area 16
    out = build_reward("geneval_lite")(speckled[None], ["p"], [{"ground_truth": target_json(BLUE_SQUARE)}])
    assert out.scores[0].item() == 0.0 and out.info["detected"] == [""]


def test_relation_follows_geneval_cone_and_threshold():
    ref = Detection("square", "red", 32, 32, 10, 10, 100)
    # 60 degree cone: an offset of (-10, 5) points left (cos > 0.5); (-5, -10) does not.
    assert relation_holds(Detection("circle", "red", 22, 37, 10, 10, 80), ref, "left of")
    assert not relation_holds(Detection("circle", "red", 27, 22, 10, 10, 80), ref, "left of")
    assert relation_holds(Detection("circle", "red", 27, 22, 10, 10, 80), ref, "above")
    # Offsets within 0.1 x (sum of sizes) = 2 px on both axes count as no relation.
    assert not relation_holds(Detection("circle", "red", 30.5, 33, 10, 10, 80), ref, "left of")


def test_ground_truth_as_dict_or_json_and_errors():
    image = render([SceneObject("square", "blue", 30, 30, 16)])[None]
    reward = build_reward("geneval_lite")
    assert reward(image, ["p"], [{"ground_truth": BLUE_SQUARE}]).scores[0].item() == 1.0
    with pytest.raises(ValueError, match="no metadata\\['ground_truth'\\]"):
        reward(image, ["p"], [{}])
    with pytest.raises(ValueError, match="not valid JSON"):
        reward(image, ["p"], [{"ground_truth": "{oops"}])
    with pytest.raises(ValueError, match="images \\(B, H, W, 3\\)"):
        reward(np.zeros((1, 2, 8, 8, 3), np.uint8), ["p"], [{"ground_truth": BLUE_SQUARE}])
    with pytest.raises(ValueError, match="min_strength"):
        build_reward("geneval_lite", {"min_strength": "1.5"})
    assert not math.isnan(reward(image, ["p"], [{"ground_truth": BLUE_SQUARE}]).scores[0].item())


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0])
def test_strict_weight_mixes_partial_credit_and_strict_accuracy(weight):
    reward = build_reward("geneval_lite", {"strict_weight": weight})
    images = np.stack(
        [
            render([SceneObject("square", "blue", 30, 30, 16)]),  # right: partial 1, strict 1
            render([SceneObject("square", "red", 30, 30, 16)]),
        ]
    )  # wrong colour: 0.5, 0
    out = reward(images, ["p", "p"], [{"ground_truth": BLUE_SQUARE}] * 2)
    assert out.scores.tolist() == pytest.approx([1.0, (1 - weight) * 0.5])
    assert out.info["accuracy"] == [1.0, 0.0]


def test_strict_weight_outside_unit_interval_is_rejected():
    with pytest.raises(ValueError, match="strict_weight"):
        build_reward("geneval_lite", {"strict_weight": 1.5})
