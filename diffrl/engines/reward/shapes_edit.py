"""shapes_edit: a rule reward for the recolour task of diffrl/engines/store/scene_edit.py (an input scene, "make the
red circle blue", the edited image): did the requested change happen, and was the rest kept?

The edited image is read with geneval_lite's detector (diffrl/engines/reward/geneval_lite.py: palette colour
segmentation, connected components, rule shape classification). The ground truth (metadata["ground_truth"], JSON)
lists the objects of the correctly edited scene, in pixels of an `image_size` scene; they are scaled to the
generated image's size. An expected object is *found* when a detection of its shape and colour has its centre within
`position_tolerance` x the object's size of the expected centre.

Score = edit_weight x edit + (1 - edit_weight) x keep, in [0, 1]:
- edit: 1 when the recoloured object is found (its shape, at its place, in the new colour), else 0;
- keep: the mean of one term per other object (1 when it is found, unchanged) and one term that is 1 when the image
  holds no detection matching no expected object (nothing added; a leftover object in the old colour counts).
info["accuracy"] is the strict 0/1: edit, every other object kept, nothing extra.
For the input image itself (no edit done) the score is (1 - edit_weight); for the correct edit it is 1.
Deviation from the published edit benchmarks (GEdit-Bench, ImgEdit judge with a VLM): rules instead, on a synthetic
task whose answer is known exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from diffrl.engines.reward.base import RewardOutput, check_positive, register_reward, to_uint8_numpy
from diffrl.engines.reward.geneval_lite import Detection, GenevalLiteOptions, describe, detect_batch


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
            f"engines.store.scene_edit.shapes_edit_prompts writes); got {str(truth)[:200]!r}"
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


def score_edit(found: list[Detection], truth: dict, image_width: int, options: ShapesEditOptions) -> tuple[float, bool]:
    """(score in [0, 1], strict accuracy) of one edited image's detections against its recolour ground truth."""
    scale = image_width / truth["image_size"]
    tol = options.position_tolerance
    hits = [[d for d in found if _matches(d, obj, scale, tol)] for obj in truth["objects"]]
    edit = float(bool(hits[truth["index"]]))
    others = [bool(h) for i, h in enumerate(hits) if i != truth["index"]]
    matched = {id(d) for h in hits for d in h}
    nothing_extra = all(id(d) in matched for d in found)
    keep_terms = [float(k) for k in others] + [float(nothing_extra)]
    keep = sum(keep_terms) / len(keep_terms)
    score = options.edit_weight * edit + (1 - options.edit_weight) * keep
    return score, bool(edit and all(others) and nothing_extra)


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
            score, strict = score_edit(found, parse_edit(meta, i), array.shape[2], self.options)
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
