"""Shape scenes: targets, captions, rendering, prompt sets and the committed held-out file."""

import json
import os
import random

import numpy as np
import pytest

from diffrl.engines.store.prompts import PromptDataset
from diffrl.shapes.scenes import (
    BACKGROUND,
    HELDOUT_SEED,
    HELDOUT_SIZE,
    PALETTE,
    TAGS,
    SceneObject,
    caption,
    random_target,
    render,
    sample_scene,
    scene_pairs,
    shapes_prompts,
    validate_target,
)

HELDOUT = os.path.join(os.path.dirname(__file__), "..", "..", "diffrl", "data", "shapes_heldout.jsonl")


def test_captions_are_plain_english():
    assert (
        caption({"tag": "counting", "include": [{"shape": "circle", "count": 2, "color": "red"}]}) == "two red circles"
    )
    assert caption({"tag": "single_object", "include": [{"shape": "triangle", "count": 1}]}) == "a triangle"
    assert (
        caption(
            {
                "tag": "position",
                "include": [
                    {"shape": "triangle", "count": 1, "color": "yellow"},
                    {"shape": "square", "count": 1, "color": "blue", "position": ["left of", 0]},
                ],
            }
        )
        == "a blue square to the left of a yellow triangle"
    )
    assert (
        caption(
            {
                "tag": "color_attr",
                "include": [
                    {"shape": "circle", "count": 1, "color": "green"},
                    {"shape": "square", "count": 1, "color": "purple"},
                ],
            }
        )
        == "a green circle and a purple square"
    )


def test_scene_pairs_are_deterministic_by_seed():
    images, captions, targets = scene_pairs(20, seed=3)
    again = scene_pairs(20, seed=3)
    assert images.shape == (20, 64, 64, 3) and images.dtype == np.uint8
    assert np.array_equal(images, again[0]) and captions == again[1] and targets == again[2]
    assert not np.array_equal(images, scene_pairs(20, seed=4)[0])


def test_render_paints_palette_colours_on_white():
    objects = [
        SceneObject("square", "red", 16, 16, 14),
        SceneObject("circle", "blue", 46, 46, 16),
        SceneObject("triangle", "green", 46, 16, 16),
    ]
    image = render(objects)
    assert tuple(image[16, 16]) == PALETTE["red"] and tuple(image[46, 46]) == PALETTE["blue"]
    assert tuple(image[19, 46]) == PALETTE["green"]  # below the triangle's centre: inside
    assert tuple(image[10, 41]) == BACKGROUND  # the triangle's top-left box corner is empty
    assert tuple(image[0, 0]) == BACKGROUND and tuple(image[63, 63]) == BACKGROUND
    # The square covers its box: 14 x 14 px fully red (edges are exact at these integer bounds).
    assert (image[9:23, 9:23] == PALETTE["red"]).all()


@pytest.mark.parametrize("relation", ["left of", "right of", "above", "below"])
def test_position_scenes_put_the_object_on_the_named_side(relation):
    rng = random.Random(0)
    target = {
        "tag": "position",
        "include": [{"shape": "square", "count": 1}, {"shape": "circle", "count": 1, "position": [relation, 0]}],
    }
    for _ in range(30):
        ref, other = sample_scene(target, rng)
        assert (ref.shape, other.shape) == ("square", "circle")
        dx, dy = other.cx - ref.cx, other.cy - ref.cy
        along = {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation]
        across = abs(dy) if relation in ("left of", "right of") else abs(dx)
        assert along >= (ref.size + other.size) / 2 + 6 and across <= along / 3


def test_scenes_hold_exactly_the_counted_objects_without_overlap():
    rng = random.Random(1)
    for _ in range(50):
        target = random_target(rng, "counting")
        objects = sample_scene(target, rng)
        item = target["include"][0]
        assert len(objects) == item["count"] and all(o.shape == item["shape"] for o in objects)
        if "color" in item:
            assert all(o.color == item["color"] for o in objects)
        boxes = [o.box() for o in objects]
        for i, a in enumerate(boxes):
            assert all(0 <= v <= 64 for v in a)
            for b in boxes[i + 1 :]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def test_shapes_prompts_carry_their_target():
    ds = shapes_prompts(60, seed=5)
    assert [r.prompt for r in ds.records] == [r.prompt for r in shapes_prompts(60, seed=5).records]
    tags = [r.metadata["tag"] for r in ds.records]
    assert all(tags.count(t) == 10 for t in TAGS)
    for r in ds.records:
        target = validate_target(json.loads(r.ground_truth))
        assert r.metadata["ground_truth"] == r.ground_truth and caption(target) == r.prompt
    with pytest.raises(ValueError, match="n must be >= 1"):
        shapes_prompts(0)


def test_committed_heldout_set_is_the_documented_generator_output():
    loaded = PromptDataset.load(HELDOUT)
    assert len(loaded) == HELDOUT_SIZE
    assert loaded.records == shapes_prompts(HELDOUT_SIZE, seed=HELDOUT_SEED).records


def test_validate_target_names_the_bad_field():
    with pytest.raises(ValueError, match=r"include\[0\].shape"):
        validate_target({"include": [{"shape": "hexagon", "count": 1}]})
    with pytest.raises(ValueError, match=r"include\[0\].count"):
        validate_target({"include": [{"shape": "circle", "count": 7}]})
    with pytest.raises(ValueError, match=r"include\[0\].color"):
        validate_target({"include": [{"shape": "circle", "count": 1, "color": "teal"}]})
    with pytest.raises(ValueError, match=r"include\[1\].position"):
        validate_target(
            {"include": [{"shape": "circle", "count": 1}, {"shape": "square", "count": 1, "position": ["near", 0]}]}
        )
