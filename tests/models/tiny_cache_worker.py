"""One of two processes of a gloo group (world 2) that ask the tiny-model cache for the same model at once.

python tiny_cache_worker.py RANK STORE_FILE ROOT: rank 1 asks for tiny sd3 first and builds it (a non-zero rank,
where transformers' save_pretrained writes nothing); rank 0 asks while rank 1 holds the folder's lock, so it waits
for that build. Each prints the folder it got.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

import torch.distributed as dist

from diffrl.models.tiny import cached_tiny


def _wait_until_locked(lock_path: str, built: str, timeout_s: float = 120.0) -> None:
    """Return once another process holds lock_path (flock) or has built the folder, polling every 10 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(built, "model_index.json")):
            return
        if os.path.exists(lock_path):
            with open(lock_path) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                except BlockingIOError:
                    return
        time.sleep(0.01)
    raise TimeoutError(f"nobody took {lock_path} in {timeout_s} s")


def main(rank: int, store: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 0:
        _wait_until_locked(os.path.join(root, "sd3-seed0.lock"), os.path.join(root, "sd3-seed0"))
    print(cached_tiny("sd3", root))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
