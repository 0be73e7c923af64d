"""OCR reward throughput on this machine's CPU.

    python -m benchmarks.reward_ocr [--images 16] [--out benchmarks/results/reward_ocr_cpu.json]

512x512 rendered-text images scored by the `ocr` reward (a MultiReward, as the run's reward role holds it) in
batches of 4, with onnxruntime on all cores and on 1 thread. Reported as images/s after a warm-up batch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from diffrl.configs.reward import RewardComponent, RewardConfig
from diffrl.engines.reward.multi import MultiReward

WORDS = ["Hidden Trail", "Open Late", "Fresh Bread", "North Gate", "Quiet Zone", "Exit Only", "Sea View", "Blue Moon"]


def make_images(count: int, size: int = 512) -> tuple[np.ndarray, list[str]]:
    """Rendered text on a light background with mild noise, and prompts quoting the text."""
    rng = np.random.default_rng(0)
    images, prompts = [], []
    for index in range(count):
        word = WORDS[index % len(WORDS)]
        image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(200, 256, 3)))
        ImageDraw.Draw(image).text(
            (size // 10, size // 2), word, fill=(20, 20, 20), font=ImageFont.load_default(size=size // 10)
        )
        noisy = np.asarray(image).astype(np.int16) + rng.integers(-10, 11, (size, size, 3))
        images.append(np.clip(noisy, 0, 255).astype(np.uint8))
        prompts.append(f'A sign that says "{word}"')
    return np.stack(images), prompts


def throughput(images: np.ndarray, prompts: list[str], num_threads: int, chunk: int = 4) -> dict:
    """images/s of one scorer over all images (warm: one batch scored first)."""
    reward = MultiReward(
        RewardConfig(components=[RewardComponent("ocr", options={"num_threads": num_threads, "batch_size": chunk})])
    )
    reward(images[:chunk], prompts[:chunk])
    started = time.perf_counter()
    output = reward(images, prompts)
    elapsed = time.perf_counter() - started
    return {
        "num_threads": num_threads,
        "images": len(images),
        "seconds": round(elapsed, 3),
        "images_per_s": round(len(images) / elapsed, 3),
        "mean_score": round(float(output.scores.mean()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "reward_ocr_cpu.json"))
    args = parser.parse_args()
    images, prompts = make_images(args.images)
    result = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            # other jobs share this CPU; the load shows how contended the numbers are
            "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        },
        "image_size": 512,
        "throughput": [throughput(images, prompts, -1), throughput(images, prompts, 1)],
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
