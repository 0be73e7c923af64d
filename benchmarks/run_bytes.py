"""Bytes a run keeps on disk per step and per sample, before and after retention.

Writes synthetic steps of a recipe's layout through the trajectory store and the flow's own retention
(diffrl/engines/step/retention.py: drop latents older than run.keep_latents_steps and compact every run.compact_every
steps, deleting old versions), then measures the run folder. Bytes depend only on the layout (latent shape, window,
image size and content), not on the model's weights, so this runs on a CPU. Images are either smooth (8x8 colour
blocks, compressing like drawn scenes) or noise (what a random-weight model decodes: PNG cannot compress it).

    python -m benchmarks.run_bytes --layout shapes --out benchmarks/results/run_bytes_cpu.json
    python -m benchmarks.run_bytes --layout qwen_image_512 --images noise
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks import common
from diffrl.engines.step.retention import KEEP_VERSIONS_S, _retain
from diffrl.engines.store.trajectories import TrajectoryStore
from diffrl.engines.trajectories import Trajectories

# (latent shape S of one sample, window W, image side): shapes_flow_grpo.yaml on reference:shapes (4 x 64 x 64
# latents, 4 SDE steps); qwen_image_ocr_lora.yaml at 512x512 (1024 packed tokens x 64, a 2-step window).
LAYOUTS = {"shapes": ((4, 64, 64), 4, 64), "qwen_image_512": ((1024, 64), 2, 512)}


def synthetic_step(layout: str, samples: int, images: str, seed: int) -> Trajectories:
    shape, window, side = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    if images == "noise":
        pixels = torch.randint(0, 256, (samples, side, side, 3), dtype=torch.uint8, generator=g)
    else:
        blocks = torch.rand(samples, 3, 8, 8, generator=g)
        pixels = (F.interpolate(blocks, size=side, mode="nearest") * 255).to(torch.uint8).permute(0, 2, 3, 1)
    return Trajectories(
        prompts=[f"prompt {i // 16}" for i in range(samples)],
        group_ids=[f"g{i // 16}" for i in range(samples)],
        sample_index=torch.arange(samples) % 16,
        seeds=torch.arange(samples),
        latents=torch.randn(samples, window + 1, *shape, generator=g),
        log_probs=torch.zeros(samples, window),
        sigmas=torch.ones(samples, window),
        sigmas_prev=torch.ones(samples, window),
        window_starts=torch.zeros(samples, dtype=torch.long),
        trained=torch.ones(samples, window, dtype=torch.bool),
        images=pixels.contiguous(),
        embed_keys=["k"] * samples,
    )


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(layout: str, samples: int, steps: int, keep: int, compact_every: int, images: str) -> dict:
    root = tempfile.mkdtemp(prefix="run_bytes_")
    try:
        store = TrajectoryStore(os.path.join(root, "trajectories.lance"))
        started = time.perf_counter()
        for step in range(steps):
            store.append(synthetic_step(layout, samples, images, step), run="bytes", step=step, chunk=0)
            compact = bool(compact_every) and (step + 1) % compact_every == 0
            if compact:
                time.sleep(KEEP_VERSIONS_S)  # the run's steps take at least this long between compactions
            _retain(store, keep, step, compact, compact_every)
        total = folder_bytes(root)
        return {
            "keep_latents_steps": keep,
            "steps": steps,
            "samples_per_step": samples,
            "bytes": total,
            "bytes_per_sample": total / steps / samples,
            "seconds": time.perf_counter() - started,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="shapes")
    parser.add_argument("--images", choices=["smooth", "noise"], default="smooth")
    parser.add_argument("--samples", type=int, default=64, help="samples per synthetic step (bytes scale with it)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compact-every", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = {
        "benchmark": "run_bytes",
        "layout": args.layout,
        "images": args.images,
        "latent_shape": LAYOUTS[args.layout][0],
        "window": LAYOUTS[args.layout][1],
        "image_side": LAYOUTS[args.layout][2],
        "before": measure(args.layout, args.samples, args.steps, -1, args.compact_every, args.images),
        "after": measure(args.layout, args.samples, args.steps, 2, args.compact_every, args.images),
        "command": " ".join(["python", "-m", "benchmarks.run_bytes", *(argv if argv is not None else sys.argv[1:])]),
    }
    for when in ("before", "after"):
        r = result[when]
        print(
            f"{args.layout} ({args.images} images), keep_latents_steps={r['keep_latents_steps']}: "
            f"{r['bytes_per_sample'] / 1e3:.1f} KB per sample after {r['steps']} steps",
            flush=True,
        )
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
