"""The shapes recolour reward on scenes drawn by diffrl's renderer: closed-form scores for the correct edit, no edit,
a wrong colour, an added object and a blank image, on prompts from the generator and the shipped set."""

import json
import os
import random
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from diffrl.engines.reward.base import build_reward
from diffrl.engines.store.prompts import PromptDataset
from diffrl.shapes.edits import edit_target, random_edit, shapes_edit_prompts
from diffrl.shapes.scenes import SceneObject, render


def _scene(objects_json: list[dict]) -> list[SceneObject]:
    return [SceneObject(**o) for o in objects_json]


def _two_object_edit() -> tuple[list[SceneObject], int, str]:
    rng = random.Random(0)
    while True:  # a scene with another object besides the recoloured one
        objects, index, color = random_edit(rng)
        if len(objects) >= 2:
            return objects, index, color


def _outside_term(edited: np.ndarray, source: np.ndarray, obj: SceneObject) -> float:
    """The pixel term by its definition, at the scene's own size (scale 1)."""
    half = obj.size / 2 + 2
    ys, xs = np.mgrid[0:64, 0:64] + 0.5
    outside = (np.abs(xs - obj.cx) > half) | (np.abs(ys - obj.cy) > half)
    return 1 - np.abs(edited.astype(float) - source.astype(float))[outside].mean() / 255


def test_scores_in_closed_form(tmp_path):
    objects, index, color = _two_object_edit()
    truth = edit_target(objects, index, color)
    source = render(objects)
    Image.fromarray(source).save(tmp_path / "in.png")
    meta = {"ground_truth": json.dumps(truth), "image": str(tmp_path / "in.png")}
    edited = _scene(truth["objects"])
    third = next(c for c in ("red", "green", "blue") if c not in (color, objects[index].color))
    wrong = [o if i != index else replace(o, color=third) for i, o in enumerate(objects)]
    extra = [*edited, SceneObject("square", "purple", 56.0, 56.0, 6.5)]
    blank = np.full((64, 64, 3), 255, np.uint8)
    images = np.stack([render(edited), source, render(wrong), render(extra), blank])
    out = build_reward("shapes_edit", {})(images, ["p"] * 5, [meta] * 5)
    k = len(objects) - 1  # the other objects
    changed = objects[index]
    assert _outside_term(images[0], source, changed) == 1.0  # a recolour changes nothing outside its box
    assert out.scores.tolist() == pytest.approx(
        [
            1.0,  # the edit, everything kept
            0.5,  # no edit: everything kept
            0.5,  # a third colour: the edit missed, everything else kept
            0.5 + 0.5 * (k + _outside_term(images[3], source, changed)) / (k + 1),  # the edit, and an added object
            0.5 * _outside_term(blank, source, changed) / (k + 1),  # nothing at all
        ]
    )
    assert out.info["accuracy"] == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_generator_records_load_back_and_score_their_own_answer(tmp_path):
    dataset = shapes_edit_prompts(6, seed=1, image_dir=str(tmp_path / "scenes"))
    again = shapes_edit_prompts(6, seed=1, image_dir=str(tmp_path / "again"))
    assert [r.prompt for r in dataset.records] == [r.prompt for r in again.records]
    records = dataset.records
    assert all(r.prompt.startswith("make the ") and r.metadata["image"].endswith(".png") for r in records)
    answers = np.stack([render(_scene(json.loads(r.ground_truth)["objects"])) for r in records])
    metadata = [{"ground_truth": r.ground_truth, **r.metadata} for r in records]
    out = build_reward("shapes_edit", {})(answers, [r.prompt for r in records], metadata)
    assert out.scores.tolist() == [1.0] * 6


def test_shipped_prompt_file_resolves_its_images():
    import diffrl

    dataset = PromptDataset.load(os.path.join(os.path.dirname(diffrl.__file__), "data", "shapes_edit.jsonl"))
    assert len(dataset) == 24
    first = dataset[0]
    assert first.metadata["image"].endswith("data/shapes_edit/000000.png") and first.ground_truth


def test_missing_or_bad_image_names_the_row(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    for image, message in (("nope.png", "row 1: image '.*nope.png' is not"), ("bad.png", "row 1: image '.*bad.png'")):
        rows = [{"prompt": "make the red circle blue"}, {"prompt": "make the red circle blue", "image": image}]
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(ValueError, match=message):
            PromptDataset.load(str(path))


def test_missing_ground_truth_is_an_error():
    with pytest.raises(ValueError, match="sample 0 has no recolour ground truth"):
        build_reward("shapes_edit", {})(np.zeros((1, 64, 64, 3), np.uint8), ["p"], [{}])
    truth = edit_target(*_two_object_edit())
    with pytest.raises(ValueError, match="sample 0 has no metadata\\['image'\\]"):
        build_reward("shapes_edit", {})(np.zeros((1, 64, 64, 3), np.uint8), ["p"], [{"ground_truth": truth}])
