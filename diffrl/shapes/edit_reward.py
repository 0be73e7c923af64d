"""shapes_edit: a rule reward for the recolour task of diffrl/shapes/edits.py (an input scene, "make the
red circle blue", the edited image): did the requested change happen, and was the rest kept?

The edited image is read with geneval_lite's detector (diffrl/shapes/geneval_lite.py: palette colour
segmentation, connected components, rule shape classification). The ground truth (metadata["ground_truth"], JSON)
lists the objects of the correctly edited scene, in pixels of an `image_size` scene; they are scaled to the
generated image's size. An expected object is *found* when a detection of its shape and colour has its centre within
`position_tolerance` x the object's size of the expected centre.

Score = edit_weight x edit + (1 - edit_weight) x keep, in [0, 1]:
- edit: 1 when the recoloured object is found (its shape, at its place, in the new colour), else 0;
- keep: the mean of one term per other object (1 when it is found, unchanged) and a pixel term, 1 - the mean
  absolute difference / 255 between the edited image and the input image (metadata["image"], resized to the edited
  image's size) outside the recoloured object's box (grown by 2 pixels of the scene): what was not asked to change
  stays. The pixel term is graded, so even images far from any scene (an untrained model's) are told apart.
info["accuracy"] is the strict 0/1: edit, every other object kept, and no detection that matches no expected object.
For the input image itself (no edit done) the score is (1 - edit_weight); for the correct edit it is 1.
Deviation from the published edit benchmarks (GEdit-Bench, ImgEdit judge with a VLM): rules instead, on a synthetic
task whose answer is known exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from diffrl.engines.reward.base import RewardOutput, check_positive, register_reward, to_uint8_numpy
from diffrl.shapes.geneval_lite import Detection, GenevalLiteOptions, describe, detect_batch


@dataclass
class ShapesEditOptions:
    """edit_weight: the share of the score for the requested change (the rest for keeping the scene).
    position_tolerance: how far (x the object's size) a detection's centre may lie from the expected one.
    color_tolerance / min_strength / min_area: geneval_lite's detector options (see GenevalLiteOptions)."""

    edit_weight: float = 0.5
    position_tolerance: float = 0.5
    color_tolerance: float = 60.0
    min_strength: float = 0.5
    min_area: int = 16
    batch_size: int = 64

    def __post_init__(self):
        if not 0 <= self.edit_weight <= 1:
            raise ValueError(f"shapes_edit: option 'edit_weight' must be in [0, 1], got {self.edit_weight}")
        check_positive(self.position_tolerance, "position_tolerance", "shapes_edit")
        check_positive(self.batch_size, "batch_size", "shapes_edit")
        self.detector = GenevalLiteOptions(
            color_tolerance=self.color_tolerance, min_strength=self.min_strength, min_area=self.min_area
        )


def parse_edit(metadata: dict, index: int) -> dict:
    """The recolour ground truth of sample `index` (metadata["ground_truth"], JSON text or a dict)."""
    truth = metadata.get("ground_truth")
    if isinstance(truth, str):
        try:
            truth = json.loads(truth)
        except json.JSONDecodeError as e:
            raise ValueError(f"shapes_edit: sample {index}: ground_truth is not valid JSON ({e})") from e
    if not isinstance(truth, dict) or truth.get("edit") != "recolor" or not isinstance(truth.get("objects"), list):
        raise ValueError(
            f"shapes_edit: sample {index} has no recolour ground truth in metadata['ground_truth'] (the JSON that "
            f"shapes.edits.shapes_edit_prompts writes); got {str(truth)[:200]!r}"
        )
    if not 0 <= truth.get("index", -1) < len(truth["objects"]):
        raise ValueError(f"shapes_edit: sample {index}: ground_truth index {truth.get('index')!r} names no object")
    return truth


def _matches(detection: Detection, expected: dict, scale: float, tolerance: float) -> bool:
    distance = math.hypot(detection.cx - expected["cx"] * scale, detection.cy - expected["cy"] * scale)
    return (
        detection.shape == expected["shape"]
        and detection.color == expected["color"]
        and distance <= tolerance * expected["size"] * scale
    )


def unchanged_outside(edited_HW3: np.ndarray, input_HW3: np.ndarray, truth: dict) -> float:
    """1 - mean |edited - input| / 255 outside the recoloured object's box (grown by 2 scene pixels), in [0, 1]."""
    height, width = edited_HW3.shape[:2]
    if input_HW3.shape[:2] != (height, width):
        input_HW3 = np.asarray(Image.fromarray(input_HW3).resize((width, height), Image.Resampling.BILINEAR))
    obj, scale = truth["objects"][truth["index"]], width / truth["image_size"]
    half = (obj["size"] / 2 + 2) * scale
    ys, xs = np.mgrid[0:height, 0:width] + 0.5
    outside = (np.abs(xs - obj["cx"] * scale) > half) | (np.abs(ys - obj["cy"] * scale) > half)
    if not outside.any():
        return 1.0
    diff = np.abs(edited_HW3.astype(np.float64) - input_HW3.astype(np.float64))[outside]
    return float(1.0 - diff.mean() / 255.0)


def score_edit(
    found: list[Detection], truth: dict, edited_HW3: np.ndarray, input_HW3: np.ndarray, options: ShapesEditOptions
) -> tuple[float, bool]:
    """(score in [0, 1], strict accuracy) of one edited image (its detections and pixels) against its recolour
    ground truth and input image."""
    scale = edited_HW3.shape[1] / truth["image_size"]
    tol = options.position_tolerance
    hits = [[d for d in found if _matches(d, obj, scale, tol)] for obj in truth["objects"]]
    edit = float(bool(hits[truth["index"]]))
    others = [bool(h) for i, h in enumerate(hits) if i != truth["index"]]
    matched = {id(d) for h in hits for d in h}
    nothing_extra = all(id(d) in matched for d in found)
    keep_terms = [float(k) for k in others] + [unchanged_outside(edited_HW3, input_HW3, truth)]
    keep = sum(keep_terms) / len(keep_terms)
    score = options.edit_weight * edit + (1 - options.edit_weight) * keep
    return score, bool(edit and all(others) and nothing_extra)


def input_image(meta: dict, index: int) -> np.ndarray:
    """Sample `index`'s input image (metadata["image"], a path) as uint8 (H, W, 3)."""
    path = meta.get("image")
    if not isinstance(path, str) or not path:
        raise ValueError(f"shapes_edit: sample {index} has no metadata['image'] (the input image's path)")
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except OSError as e:
        raise ValueError(f"shapes_edit: sample {index}: cannot read the input image {path!r} ({e})") from None


@dataclass
class ShapesEditReward:
    """Stateless apart from its options."""

    options: ShapesEditOptions
    name: str = "shapes_edit"

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(images)
        if array.ndim != 4:
            raise ValueError(f"shapes_edit scores images (B, H, W, 3), got shape {tuple(array.shape)}")
        if len(metadata) != len(array):
            raise ValueError(f"shapes_edit: got {len(array)} images but {len(metadata)} metadata entries")
        scores, accuracy, seen = [], [], []
        for i, (found, meta) in enumerate(zip(detect_batch(array, self.options.detector), metadata)):
            score, strict = score_edit(found, parse_edit(meta, i), array[i], input_image(meta, i), self.options)
            scores.append(score)
            accuracy.append(float(strict))
            seen.append(describe(found))
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            valid=torch.ones(len(scores), dtype=torch.bool),
            info={"accuracy": accuracy, "detected": seen},
        )


@register_reward("shapes_edit", options=ShapesEditOptions)
def shapes_edit(options: ShapesEditOptions) -> ShapesEditReward:
    """Rule reward of the shapes recolour task: the requested change made, the rest of the scene kept."""
    return ShapesEditReward(options=options)
