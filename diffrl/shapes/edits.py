"""An offline image-editing task on the shape scenes: recolour one object (the prompt set of
diffrl/configs/qwen_image_edit_flow_grpo.yaml and of the `shapes_edit` reward).

Each input scene is drawn by the shapes renderer (diffrl/shapes/scenes.py: palette, shapes, anti-aliased
64x64): 1 to 3 objects, each a random shape and colour, placed without overlap, one of them unique by its colour and
shape. The instruction names that object and a new colour: "make the red circle blue". The edited scene is the same
objects with that one recoloured; it is the ground truth the reward checks (the requested change, and that every
other object stays as it was).

Record: prompt = the instruction, metadata = {"image": the input PNG (by path), "task": "shapes_edit",
"ground_truth": the edit as JSON}; the ground truth is
    {"edit": "recolor", "index": k, "from": "red", "to": "blue", "image_size": 64,
     "objects": [{"shape", "color", "cx", "cy", "size"} of the edited scene, ...]}
Deterministic by seed: the same (n, seed) gives the same scenes, instructions and files on every machine.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, replace

from PIL import Image

from diffrl.engines.store.prompts import PromptDataset, PromptRecord, prompt_uid
from diffrl.shapes.scenes import PALETTE, SHAPES, SceneObject, _place, render

IMAGE_SIZE = 64
MAX_OBJECTS = 3
SHIPPED_SEED = 4_242  # diffrl/data/shapes_edit.jsonl = shapes_edit_prompts(SHIPPED_SIZE, SHIPPED_SEED, ...)
SHIPPED_SIZE = 24


def instruction(obj: SceneObject, new_color: str) -> str:
    """'make the red circle blue'."""
    return f"make the {obj.color} {obj.shape} {new_color}"


def random_edit(rng: random.Random, image_size: int = IMAGE_SIZE) -> tuple[list[SceneObject], int, str]:
    """(input objects, index of the object to recolour, its new colour); that object is the only one of its colour
    and shape, so the instruction names it unambiguously."""
    lo, hi = image_size * 0.19, image_size * 0.28  # the shapes scenes' object sizes
    while True:
        count = rng.randint(1, MAX_OBJECTS)
        objects, boxes = [], []
        for _ in range(count):
            size = rng.uniform(lo, hi)
            centre = _place(rng, size, image_size, boxes, gap=4)
            if centre is None:
                break
            obj = SceneObject(rng.choice(SHAPES), rng.choice(sorted(PALETTE)), *centre, size)
            objects.append(obj)
            boxes.append(obj.box())
        unique = [
            i for i, o in enumerate(objects) if sum((p.shape, p.color) == (o.shape, o.color) for p in objects) == 1
        ]
        if len(objects) < count or not unique:  # redraw: an object did not fit, or none is named unambiguously
            continue
        index = rng.choice(unique)
        new_color = rng.choice([c for c in sorted(PALETTE) if c != objects[index].color])
        return objects, index, new_color


def edit_target(objects: list[SceneObject], index: int, new_color: str, image_size: int = IMAGE_SIZE) -> dict:
    """The ground truth of a recolour edit (the edited scene and what changed)."""
    edited = [replace(o, color=new_color) if i == index else o for i, o in enumerate(objects)]
    return {
        "edit": "recolor",
        "index": index,
        "from": objects[index].color,
        "to": new_color,
        "image_size": image_size,
        "objects": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(o).items()} for o in edited],
    }


def shapes_edit_prompts(n: int, seed: int, image_dir: str) -> PromptDataset:
    """n recolour instructions with their input scenes written as PNGs to `image_dir` (kept when already there)."""
    if n < 1:
        raise ValueError(f"shapes_edit_prompts: n must be >= 1, got {n}")
    rng = random.Random(seed)
    os.makedirs(image_dir, exist_ok=True)
    records = []
    for i in range(n):
        objects, index, new_color = random_edit(rng)
        prompt = instruction(objects[index], new_color)
        truth = json.dumps(edit_target(objects, index, new_color), sort_keys=True)
        image = _draw(objects, os.path.join(image_dir, f"{i:06d}.png"))
        metadata = {"image": image, "task": "shapes_edit", "ground_truth": truth}
        records.append(PromptRecord(uid=prompt_uid(i, prompt), prompt=prompt, ground_truth=truth, metadata=metadata))
    return PromptDataset(records, source=f"shapes_edit_prompts(n={n}, seed={seed})")


def _draw(objects: list[SceneObject], path: str) -> str:
    """The scene's PNG at `path` (drawn once; two processes drawing the same set never see half a file)."""
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        Image.fromarray(render(objects, IMAGE_SIZE)).save(tmp, format="PNG")
        os.replace(tmp, path)
    return path


def write_shipped(path: str) -> None:
    """diffrl/data/shapes_edit.jsonl and its PNGs in diffrl/data/shapes_edit/ (image paths relative to the file)."""
    folder = os.path.dirname(os.path.abspath(path))
    dataset = shapes_edit_prompts(SHIPPED_SIZE, SHIPPED_SEED, os.path.join(folder, "shapes_edit"))
    with open(path, "w", encoding="utf-8") as f:
        for r in dataset.records:
            meta = {k: v for k, v in r.metadata.items() if k not in ("image", "ground_truth")}
            image = os.path.relpath(r.metadata["image"], folder)
            row = {"uid": r.uid, "prompt": r.prompt, "image": image, "ground_truth": r.ground_truth, "metadata": meta}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":  # python -m diffrl.shapes.edits diffrl/data/shapes_edit.jsonl
    import sys

    write_shipped(sys.argv[1] if len(sys.argv) > 1 else "diffrl/data/shapes_edit.jsonl")
