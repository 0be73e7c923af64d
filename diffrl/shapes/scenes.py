"""Procedural shape scenes: GenEval-style targets, scene specs, PIL rendering, captions, prompt sets.

A *target* is what a prompt asks for, in a GenEval-like structure (JSON-serialisable):
    {"tag": "position", "include": [{"shape": "square", "count": 1},
                                    {"shape": "circle", "count": 1, "position": ["left of", 0]}]}
`include` items have `shape` (circle | square | triangle), `count` (1-4), optional `color` (a PALETTE
name) and optional `position` = [relation, index of the reference item]; the example reads "a circle to
the left of a square". Tags are GenEval's: single_object, two_object, counting, colors, position,
color_attr.

A *scene* is one concrete image for a target: objects (shape, colour, centre, size) on a white
background. Unspecified colours, sizes and positions are drawn at random, so one caption maps to many
images (the distribution a text-to-image model learns). Everything is deterministic by seed.

Images are uint8 (S, S, 3), S = `size` (64 by default); coordinates are in pixels of that image.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from diffrl.engines.store.png import ZLIB_DEFAULT, encode_png
from diffrl.engines.store.prompts import PromptDataset, PromptRecord, prompt_uid

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Well-separated colours on a white background (the reward tells them apart by RGB distance).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "yellow": (235, 200, 20),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "purple": (140, 40, 190),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
_NUMBER_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
_RELATION_PHRASES = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}
_SUPERSAMPLE = 4  # render at 4x and box-downsample: anti-aliased edges, as a generative model's would be


@dataclass(frozen=True)
class SceneObject:
    """One object: shape, colour name, centre (cx, cy) and side length `size` of its bounding box, in pixels."""

    shape: str
    color: str
    cx: float
    cy: float
    size: float

    def box(self) -> tuple[float, float, float, float]:
        half = self.size / 2
        return (self.cx - half, self.cy - half, self.cx + half, self.cy + half)


# ------------------------------------------------------------------------------------ targets
def random_target(rng: random.Random, tag: str | None = None) -> dict:
    """A random target of `tag` (uniform over TAGS when None)."""
    tag = rng.choice(TAGS) if tag is None else tag
    if tag not in TAGS:
        raise ValueError(f"tag must be one of {', '.join(TAGS)}; got {tag!r}")
    a, b = rng.sample(SHAPES, 2)
    ca, cb = rng.sample(sorted(PALETTE), 2)
    if tag == "single_object":
        include = [{"shape": a, "count": 1}]
    elif tag == "two_object":
        include = [{"shape": a, "count": 1}, {"shape": b, "count": 1}]
    elif tag == "counting":
        include = [{"shape": a, "count": rng.choice((2, 3, 4))}]
        if rng.random() < 0.5:  # "two red circles" as well as "three triangles"
            include[0]["color"] = ca
    elif tag == "colors":
        include = [{"shape": a, "count": 1, "color": ca}]
    elif tag == "position":
        include = [{"shape": a, "count": 1}, {"shape": b, "count": 1, "position": [rng.choice(RELATIONS), 0]}]
    else:  # color_attr
        include = [{"shape": a, "count": 1, "color": ca}, {"shape": b, "count": 1, "color": cb}]
    return {"tag": tag, "include": include}


def _noun(item: dict) -> str:
    """'a red circle', 'three triangles' (plural with an s: all shape names take one)."""
    count = item["count"]
    words = [_NUMBER_WORDS[count]] + ([item["color"]] if "color" in item else [])
    words.append(item["shape"] + ("s" if count > 1 else ""))
    return " ".join(words)


def caption(target: dict) -> str:
    """Plain-English prompt of a target: 'two red circles', 'a circle to the left of a square'."""
    include = target["include"]
    if target["tag"] == "position":
        relation, ref = include[1]["position"]
        return f"{_noun(include[1])} {_RELATION_PHRASES[relation]} {_noun(include[ref])}"
    return " and ".join(_noun(item) for item in include)


def validate_target(target: dict) -> dict:
    """Checks the structure of a target (ValueError naming the bad field) and returns it."""
    if not isinstance(target, dict) or not isinstance(target.get("include"), list) or not target["include"]:
        raise ValueError(f"a shapes target must be a dict with a non-empty 'include' list; got {target!r}")
    for i, item in enumerate(target["include"]):
        if item.get("shape") not in SHAPES:
            raise ValueError(f"include[{i}].shape must be one of {', '.join(SHAPES)}; got {item.get('shape')!r}")
        if item.get("count") not in _NUMBER_WORDS:
            raise ValueError(f"include[{i}].count must be 1..4; got {item.get('count')!r}")
        if "color" in item and item["color"] not in PALETTE:
            raise ValueError(f"include[{i}].color must be one of {', '.join(PALETTE)}; got {item['color']!r}")
        if "position" in item:
            relation, ref = item["position"]
            if relation not in RELATIONS or not (
                isinstance(ref, int) and 0 <= ref < len(target["include"]) and ref != i
            ):
                raise ValueError(
                    f"include[{i}].position must be [relation, other item index] with relation in "
                    f"{', '.join(RELATIONS)}; got {item['position']!r}"
                )
    return target


# ------------------------------------------------------------------------------------- scenes
def _overlaps(box, boxes, gap: float) -> bool:
    x0, y0, x1, y1 = box
    return any(x0 < b[2] + gap and b[0] < x1 + gap and y0 < b[3] + gap and b[1] < y1 + gap for b in boxes)


def _place(rng: random.Random, size: float, image_size: int, boxes: list, gap: float) -> tuple[float, float] | None:
    margin = 2 + size / 2
    for _ in range(100):
        cx, cy = rng.uniform(margin, image_size - margin), rng.uniform(margin, image_size - margin)
        half = size / 2
        if not _overlaps((cx - half, cy - half, cx + half, cy + half), boxes, gap):
            return cx, cy
    return None


def _place_pair(rng: random.Random, sizes: tuple[float, float], relation: str, image_size: int):
    """Centres of (reference, other) with `other` clearly `relation` of `reference`: the offset along the
    relation's axis is at least the sum of the half sizes + 6 px and twice the offset across it."""
    s_ref, s_other = sizes
    lo = (s_ref + s_other) / 2 + 6
    for _ in range(200):
        along = rng.uniform(lo, image_size - 4 - lo / 2)
        across = rng.uniform(-along / 3, along / 3)
        sign = -1 if relation in ("left of", "above") else 1
        dx, dy = (sign * along, across) if relation in ("left of", "right of") else (across, sign * along)
        ref_c = (
            rng.uniform(2 + s_ref / 2, image_size - 2 - s_ref / 2),
            rng.uniform(2 + s_ref / 2, image_size - 2 - s_ref / 2),
        )
        other_c = (ref_c[0] + dx, ref_c[1] + dy)
        if all(2 + s_other / 2 <= v <= image_size - 2 - s_other / 2 for v in other_c):
            return ref_c, other_c
    raise AssertionError("could not place a position pair; image too small for the object sizes")


def sample_scene(target: dict, rng: random.Random, image_size: int = 64) -> list[SceneObject]:
    """One random scene satisfying `target` exactly: the included objects and nothing else."""
    lo, hi = image_size * 0.19, image_size * 0.28  # 12-18 px object sides at 64x64
    include = target["include"]
    for _ in range(50):
        objects: list[SceneObject] = []
        if target["tag"] == "position":
            relation, ref = include[1]["position"]
            sizes = (rng.uniform(lo, hi), rng.uniform(lo, hi))
            ref_c, other_c = _place_pair(rng, sizes, relation, image_size)
            for item, c, s in ((include[ref], ref_c, sizes[0]), (include[1], other_c, sizes[1])):
                objects.append(
                    SceneObject(item["shape"], item.get("color") or rng.choice(sorted(PALETTE)), c[0], c[1], s)
                )
            return objects
        boxes: list = []
        for item in include:
            for _ in range(item["count"]):
                size = rng.uniform(lo, hi)
                centre = _place(rng, size, image_size, boxes, gap=3)
                if centre is None:
                    break
                obj = SceneObject(item["shape"], item.get("color") or rng.choice(sorted(PALETTE)), *centre, size)
                objects.append(obj)
                boxes.append(obj.box())
        if len(objects) == sum(item["count"] for item in include):
            return objects
    raise AssertionError(f"could not place the objects of {target!r} without overlap")


def render(objects: list[SceneObject], image_size: int = 64) -> np.ndarray:
    """uint8 (S, S, 3) image of the objects on a white background, anti-aliased (4x supersampled).

    circle: the disc inscribed in the box; square: the box (axis-aligned); triangle: upright isosceles,
    apex at the top centre, base along the bottom of the box."""
    k = _SUPERSAMPLE
    canvas = Image.new("RGB", (image_size * k, image_size * k), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        x0, y0, x1, y1 = (v * k for v in obj.box())
        fill = PALETTE[obj.color]
        if obj.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif obj.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif obj.shape == "triangle":
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
        else:
            raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got {obj.shape!r}")
    return np.asarray(canvas.resize((image_size, image_size), Image.Resampling.BOX), dtype=np.uint8)


def scene_pairs(n: int, seed: int, image_size: int = 64) -> tuple[np.ndarray, list[str], list[dict]]:
    """n training pairs: images uint8 (n, S, S, 3), captions, targets. Deterministic by seed."""
    rng = random.Random(seed)
    images = np.empty((n, image_size, image_size, 3), dtype=np.uint8)
    captions, targets = [], []
    for i in range(n):
        target = random_target(rng)
        images[i] = render(sample_scene(target, rng, image_size), image_size)
        captions.append(caption(target))
        targets.append(target)
    return images, captions, targets


# ------------------------------------------------------------------------------------ prompts
def target_json(target: dict) -> str:
    """Canonical JSON text of a target (sorted keys): the ground-truth column the reward reads."""
    return json.dumps(target, sort_keys=True)


def shapes_prompts(n: int, seed: int = 0) -> PromptDataset:
    """n shape prompts with their targets (source `generator:shapes`); uniform over TAGS.

    Each record: prompt = caption(target), ground_truth = target_json(target), metadata = {"task":
    "shapes", "tag": tag, "ground_truth": same JSON}. The held-out set data/shapes_heldout.jsonl was
    made with seed HELDOUT_SEED; RL configs must use other seeds.
    """
    if n < 1:
        raise ValueError(f"shapes_prompts: n must be >= 1, got {n}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        target = random_target(rng, TAGS[i % len(TAGS)])  # balanced categories
        prompt, truth = caption(target), target_json(target)
        records.append(
            PromptRecord(
                uid=prompt_uid(i, prompt),
                prompt=prompt,
                ground_truth=truth,
                metadata={"task": "shapes", "tag": target["tag"], "ground_truth": truth},
            )
        )
    return PromptDataset(records, source=f"shapes_prompts(n={n}, seed={seed})")


def write_sft_dataset(path: str, n: int, *, image_size: int = 64, seed: int = 0) -> str:
    """An SFT dataset of n rendered scenes (source `generator:shapes` with `algorithm: sft`): parquet columns prompt,
    uid, image (PNG bytes) and ground_truth (target_json, what geneval_lite scores); the prompts are balanced over
    TAGS as shapes_prompts balances them, each image a scene that satisfies its prompt (the ground truth the shapes
    models were pretrained on). Deterministic by seed."""
    if n < 1:
        raise ValueError(f"write_sft_dataset: n must be >= 1, got {n}")
    rng = random.Random(seed)
    prompts, uids, images, truths = [], [], [], []
    for i in range(n):
        target = random_target(rng, TAGS[i % len(TAGS)])
        prompts.append(caption(target))
        truths.append(target_json(target))
        uids.append(prompt_uid(i, prompts[-1]))
        images.append(encode_png(render(sample_scene(target, rng, image_size), image_size), ZLIB_DEFAULT))
    table = pa.table({"prompt": prompts, "uid": uids, "image": pa.array(images, pa.binary()), "ground_truth": truths})
    pq.write_table(table, path)
    return path


HELDOUT_SEED = 90_210  # data/shapes_heldout.jsonl = shapes_prompts(204, seed=HELDOUT_SEED)
HELDOUT_SIZE = 204  # 34 per tag


def write_prompts_jsonl(dataset: PromptDataset, path: str) -> None:
    """Writes a prompt set as JSON lines (uid, prompt, ground_truth, metadata) that PromptDataset.load reads."""
    with open(path, "w", encoding="utf-8") as f:
        for r in dataset.records:
            f.write(
                json.dumps({"uid": r.uid, "prompt": r.prompt, "ground_truth": r.ground_truth, "metadata": r.metadata})
                + "\n"
            )


if __name__ == "__main__":  # python -m diffrl.shapes.scenes diffrl/data/shapes_heldout.jsonl
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "diffrl/data/shapes_heldout.jsonl"
    write_prompts_jsonl(shapes_prompts(HELDOUT_SIZE, seed=HELDOUT_SEED), out)
    print(f"wrote {HELDOUT_SIZE} prompts (seed {HELDOUT_SEED}) to {out}")
