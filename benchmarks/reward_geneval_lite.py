"""geneval_lite throughput on this machine's CPU: the batched scorer against one image at a time.

    python -m benchmarks.reward_geneval_lite [--images 512] [--repeats 5] \
        [--out benchmarks/results/reward_geneval_lite_cpu.json]

Images: rendered shape scenes (shapes.scenes.scene_pairs) with Gaussian pixel noise of std 20, as
rollout images are noisier than renders. Scored through MultiReward (the reward's own batch_size, 64) and,
for comparison, by the same functions one image at a time (`detect` and `score_detections` per image, the
loop geneval_lite ran before it scored batches in array passes). Median of --repeats timed passes after one
warm-up; the two must give the same scores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np

from benchmarks.common import time_median, write_json
from diffrl.configs.reward import RewardComponent, RewardConfig
from diffrl.engines.reward.multi import MultiReward
from diffrl.shapes.geneval_lite import GenevalLiteOptions, detect, parse_target, score_detections
from diffrl.shapes.scenes import scene_pairs, target_json


def noisy_scenes(count: int, size: int, seed: int = 3) -> tuple[np.ndarray, list[str], list[dict]]:
    images, prompts, targets = scene_pairs(count, seed=seed, image_size=size)
    noise = np.random.default_rng(seed).normal(0, 20, images.shape)
    return (
        np.clip(images + noise, 0, 255).astype(np.uint8),
        prompts,
        [{"ground_truth": target_json(t)} for t in targets],
    )


def measure(count: int, size: int, repeats: int) -> dict:
    images, prompts, metadata = noisy_scenes(count, size)
    reward = MultiReward(RewardConfig(components=[RewardComponent("geneval_lite")]))
    options = GenevalLiteOptions()

    def batched():
        return reward(images, prompts, metadata).scores.numpy()

    def one_at_a_time():
        return np.asarray(
            [
                score_detections(detect(image, options), parse_target(meta, i))[0]
                for i, (image, meta) in enumerate(zip(images, metadata))
            ],
            dtype=np.float32,
        )

    scores = batched()
    if not np.array_equal(scores, one_at_a_time()):
        raise SystemExit("batched and per-image scores differ")
    batched_s = time_median(batched, repeats=repeats, warmup=1, device="cpu")
    one_s = time_median(one_at_a_time, repeats=repeats, warmup=1, device="cpu")
    return {
        "image_size": size,
        "images": count,
        "batched_s": round(batched_s, 4),
        "per_image_s": round(one_s, 4),
        "batched_images_per_s": round(count / batched_s, 1),
        "per_image_images_per_s": round(count / one_s, 1),
        "speedup": round(one_s / batched_s, 2),
        "mean_score": round(float(scores.mean()), 4),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.machine(),
            "python": platform.python_version(),
            "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        },
        "command": "python -m benchmarks.reward_geneval_lite " + f"--images {args.images} --repeats {args.repeats}",
        "runs": [measure(args.images, 64, args.repeats), measure(max(1, args.images // 16), 256, args.repeats)],
    }
    print(json.dumps(results, indent=2))
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
