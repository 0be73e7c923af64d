"""OCR reward throughput and reward-pool overlap, on this machine's CPU.

    python benchmarks/reward_ocr.py [--images 16] [--out benchmarks/results/reward_ocr_cpu.json]

1. Throughput: 512x512 rendered-text images scored by the `ocr` reward through a RewardPool
   (thread mode) with 1 worker (onnxruntime on all cores) and 2 workers (1 thread each, and all
   cores each), in chunks of 4. Reported as images/s, after a warm-up chunk per worker.
2. Overlap: a chunked "rollout" that sleeps `--rollout-s` per chunk (standing in for GPU
   denoising, which a CPU cannot run) submits each chunk to the pool as it is produced. Checks
   total wall time < rollout time + reward time, and records timing_s/reward_overlap.
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

from diffrl.engines.reward.multi import MultiReward, RewardComponent, RewardConfig
from diffrl.engines.reward.pool import RewardPool

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


def throughput(images: np.ndarray, prompts: list[str], workers: int, num_threads: int, chunk: int = 4) -> dict:
    """images/s of the pool over all images (warm: one chunk per worker scored first)."""
    options = {"num_threads": num_threads, "batch_size": chunk}
    config = RewardConfig(
        components=[RewardComponent("ocr", options=options)], workers=workers, max_pending_chunks=2 * workers
    )
    with RewardPool(config) as pool:
        for warm in range(workers):
            pool.submit(warm, images[:chunk], prompts[:chunk])
        pool.results()
        started = time.perf_counter()
        for chunk_id, start in enumerate(range(0, len(images), chunk)):
            pool.submit(chunk_id, images[start : start + chunk], prompts[start : start + chunk])
        results = pool.results()
        elapsed = time.perf_counter() - started
    scores = np.concatenate([results[i].scores.numpy() for i in sorted(results)])
    return {
        "workers": workers,
        "num_threads_per_worker": num_threads,
        "images": len(images),
        "seconds": round(elapsed, 3),
        "images_per_s": round(len(images) / elapsed, 3),
        "mean_score": round(float(scores.mean()), 4),
    }


def overlap(images: np.ndarray, prompts: list[str], rollout_s: float, chunk: int = 4) -> dict:
    """Chunked fake rollout + pool: total vs rollout + reward, and the pool's overlap stats."""
    config = RewardConfig(components=[RewardComponent("ocr", options={"batch_size": chunk})], workers=1)
    reward = MultiReward(config)
    reward(images[:1], prompts[:1])  # warm-up
    started = time.perf_counter()
    for start in range(0, len(images), chunk):
        reward(images[start : start + chunk], prompts[start : start + chunk])
    reward_s = time.perf_counter() - started
    chunks = range(0, len(images), chunk)
    with RewardPool(config) as pool:
        pool.submit(-1, images[:1], prompts[:1])
        pool.results()  # warm-up
        started = time.perf_counter()
        for chunk_id, start in enumerate(chunks):
            time.sleep(rollout_s)  # the rollout producing this chunk
            pool.submit(chunk_id, images[start : start + chunk], prompts[start : start + chunk])
        pool.results()
        total_s = time.perf_counter() - started
        stats = pool.overlap_stats()
    rollout_total = rollout_s * len(chunks)
    return {
        "chunks": len(chunks),
        "rollout_s": round(rollout_total, 3),
        "reward_s_sequential": round(reward_s, 3),
        "total_s": round(total_s, 3),
        "rollout_plus_reward_s": round(rollout_total + reward_s, 3),
        "total_below_sum": total_s < rollout_total + reward_s,
        **{k: round(v, 3) for k, v in stats.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--rollout-s", type=float, default=3.0, help="fake rollout time per chunk of 4")
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
        "throughput": [
            throughput(images, prompts, 1, -1),
            throughput(images, prompts, 2, 1),
            throughput(images, prompts, 2, -1),
        ],
        "overlap": overlap(images, prompts, args.rollout_s),
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
