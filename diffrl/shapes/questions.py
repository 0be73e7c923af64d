"""Questions about drawn shape scenes, answered from the image: the prompt set of the autoregressive quickstart
(diffrl/configs/omni_quick.yaml).

Each scene is drawn by the shapes generator's own renderer (diffrl/shapes/scenes.py: the same shapes, palette
and anti-aliased 64x64 drawing the reference shapes model learned from): 1 to 4 objects, each a random shape and
colour, placed without overlap. One question per scene, uniform over QUESTION_TYPES:

    count_shape   "how many circles?"            -> "0" .. "4"
    color_of      "what color is the square?"    -> a PALETTE name (the scene holds exactly one square)
    shape_of      "what shape is the red one?"   -> a shape name (the scene holds exactly one red object)

The image is written once as a PNG under `image_dir` and referenced by path from the record
(metadata["images"]), never inlined: a prompt row stays a few hundred bytes. Deterministic by seed: the same
(n, seed) gives the same scenes, questions and files on every machine.
"""

from __future__ import annotations

import os
import random

from PIL import Image

from diffrl.engines.store.prompts import PromptDataset, PromptRecord, prompt_uid
from diffrl.shapes.scenes import PALETTE, SHAPES, SceneObject, _place, render

QUESTION_TYPES = ("count_shape", "color_of", "shape_of")
IMAGE_SIZE = 64
MAX_OBJECTS = 4
HELDOUT_SEED = 31_337  # generator:shapes_qa_heldout = scene_questions(HELDOUT_SIZE, HELDOUT_SEED)
HELDOUT_SIZE = 192


def answer_vocabulary() -> list[str]:
    """Every answer and question word of the task (a tokenizer built for it makes each one token)."""
    numbers = [str(k) for k in range(MAX_OBJECTS + 1)]
    questions = ["how many", "what color is the", "what shape is the", "one?", "shape", "color"]
    return [*numbers, *SHAPES, *sorted(PALETTE), *[s + "s" for s in SHAPES], *questions]


def random_objects(rng: random.Random, image_size: int = IMAGE_SIZE) -> list[SceneObject]:
    """1..MAX_OBJECTS objects of random shape and colour, non-overlapping (sizes as the shapes scenes')."""
    lo, hi = image_size * 0.19, image_size * 0.28
    count = rng.randint(1, MAX_OBJECTS)
    for _ in range(50):
        objects, boxes = [], []
        for _ in range(count):
            size = rng.uniform(lo, hi)
            centre = _place(rng, size, image_size, boxes, gap=3)
            if centre is None:
                break
            obj = SceneObject(rng.choice(SHAPES), rng.choice(sorted(PALETTE)), *centre, size)
            objects.append(obj)
            boxes.append(obj.box())
        if len(objects) == count:
            return objects
    raise AssertionError(f"could not place {count} objects without overlap")


def ask(objects: list[SceneObject], kind: str, rng: random.Random) -> tuple[str, str] | None:
    """(question, answer) of type `kind` about the scene, or None when the scene cannot answer it unambiguously."""
    if kind == "count_shape":
        shape = rng.choice(SHAPES)
        return f"how many {shape}s?", str(sum(o.shape == shape for o in objects))
    if kind == "color_of":
        unique = [s for s in SHAPES if sum(o.shape == s for o in objects) == 1]
        if not unique:
            return None
        shape = rng.choice(unique)
        return f"what color is the {shape}?", next(o.color for o in objects if o.shape == shape)
    if kind == "shape_of":
        unique = [c for c in sorted(PALETTE) if sum(o.color == c for o in objects) == 1]
        if not unique:
            return None
        color = rng.choice(unique)
        return f"what shape is the {color} one?", next(o.shape for o in objects if o.color == color)
    raise ValueError(f"question type must be one of {QUESTION_TYPES}; got {kind!r}")


def describe(objects: list[SceneObject]) -> str:
    """The scene in words, objects left to right: "red circle, blue square, red triangle"."""
    return ", ".join(f"{o.color} {o.shape}" for o in sorted(objects, key=lambda o: o.cx))


def scene_questions(n: int, seed: int, image_dir: str | None) -> PromptDataset:
    """n scene questions (types in turn), their PNGs written to `image_dir` (kept when already there); with
    image_dir None the scene is told in words instead (the text variant: no image, the same questions).

    Record: prompt = the question (text variant: "<scene in words>. <question>"), ground_truth = the answer,
    metadata = {"images": [png path] (image variant only), "task": "shapes_qa", "question_type": kind}."""
    if n < 1:
        raise ValueError(f"scene_questions: n must be >= 1, got {n}")
    rng = random.Random(seed)
    if image_dir is not None:
        os.makedirs(image_dir, exist_ok=True)
    records = []
    for i in range(n):
        kind = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        qa = None
        while qa is None:  # redraw scenes that cannot answer this kind of question
            objects = random_objects(rng)
            qa = ask(objects, kind, rng)
        question, answer = qa
        metadata = {"task": "shapes_qa", "question_type": kind}
        if image_dir is None:
            question = f"{describe(objects)}. {question}"
        else:
            metadata["images"] = [_draw(objects, os.path.join(image_dir, f"{i:06d}.png"))]
        records.append(
            PromptRecord(uid=prompt_uid(i, question), prompt=question, ground_truth=answer, metadata=metadata)
        )
    return PromptDataset(records, source=f"scene_questions(n={n}, seed={seed})")


def _draw(objects: list[SceneObject], path: str) -> str:
    """The scene's PNG at `path` (drawn once; two processes drawing the same set never see half a file)."""
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        Image.fromarray(render(objects, IMAGE_SIZE)).save(tmp, format="PNG")
        os.replace(tmp, path)
    return path
