"""Trajectory-store I/O for one Qwen-Image-size step: 512 samples x 3 latents x 1024 x 64 fp32.

Writes the step as 8 chunks of 64 (as the rollout does), reads it back whole and as 1 of 8 rank
shards, and times PNG encode/decode of 512x512 images separately (that cost is per image and
runs in the rollout worker). Run:
    .venv/bin/python -m benchmarks.store_io --out benchmarks/results/store_io_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

from diffrl.engines.store.records import decode_images, encode_images
from diffrl.engines.store.synthetic import random_trajectories
from diffrl.engines.store.trajectories import TrajectoryStore


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(root: str, samples: int, chunks: int, latent_shape: tuple[int, ...], png_images: int) -> dict:
    per_chunk = samples // chunks
    group = 16
    parts = [
        random_trajectories(
            per_chunk // group,
            group,
            latent_shape=latent_shape[1:],
            window=latent_shape[0] - 1,
            image_size=16,
            seed=c,
            prompt_offset=c * per_chunk,
        )
        for c in range(chunks)
    ]
    latent_mb = sum(p.latents.numel() * 4 for p in parts) / 1e6
    store = TrajectoryStore(os.path.join(root, "trajectories.lance"))
    write_s = 0.0
    for c, part in enumerate(parts):
        _, dt = timed(lambda: store.append(part, run="bench", step=0, chunk=c))
        write_s += dt
    read, read_s = timed(lambda: store.read_step(0))
    assert torch.equal(read.latents[:per_chunk], parts[0].latents)
    _, shard_s = timed(lambda: store.read_step(0, rank=3, world_size=8, with_images=False))
    _, keys_s = timed(lambda: store.committed_chunks(0))
    # Baseline on the same data: one raw Lance append + scan of the latents alone.
    import lance
    import pyarrow as pa

    flat = torch.cat([p.latents for p in parts]).reshape(samples, -1).numpy()
    raw = pa.table({"latents": pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])})
    _, raw_write_s = timed(lambda: lance.write_dataset(raw, os.path.join(root, "raw.lance")))
    _, raw_read_s = timed(lambda: lance.dataset(os.path.join(root, "raw.lance")).to_table())
    big = random_trajectories(1, png_images, image_size=512, seed=0).images
    (blobs, _), enc_s = timed(lambda: encode_images(big))
    _, dec_s = timed(lambda: decode_images(blobs, 0))
    return {
        "latents_MB": round(latent_mb, 1),
        "write_s": round(write_s, 3),
        "write_MB_per_s": round(latent_mb / write_s, 1),
        "read_step_s": round(read_s, 3),
        "read_MB_per_s": round(latent_mb / read_s, 1),
        "raw_lance_write_MB_per_s": round(latent_mb / raw_write_s, 1),
        "raw_lance_read_MB_per_s": round(latent_mb / raw_read_s, 1),
        "read_shard_1_of_8_s": round(shard_s, 3),
        "committed_chunks_check_s": round(keys_s, 4),
        "png_512x512_encode_ms_per_image": round(1000 * enc_s / png_images, 1),
        "png_512x512_decode_ms_per_image": round(1000 * dec_s / png_images, 1),
        "png_512x512_KB_per_image": round(sum(map(len, blobs)) / len(blobs) / 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--png-images", type=int, default=16)
    parser.add_argument("--root", default=None, help="directory for the table (default: a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="store_io_")
    try:
        result = run(root, args.samples, args.chunks, (3, 1024, 64), args.png_images)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    import lance

    record = {
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pylance": lance.__version__,
            "storage": "local disk (tmp)",
            "load_average_1m_at_end": round(os.getloadavg()[0], 1),
        },
        "shape": {"samples": args.samples, "chunks": args.chunks, "latents_per_sample": [3, 1024, 64]},
        "result": result,
    }
    print(json.dumps(record, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
