"""PNG encoding of a batch of uint8 images, off the training process's GIL when the batch is large.

Encoding in threads of the training process looked free but was not: on the shapes GPU recipe (512 64x64 images a
step) the encoder threads held the GIL about 0.1 s a step (py-spy --gil, one H100), in small slices that the
kernel-launch-bound update and rollout had to wait for. Large batches are encoded by a pool of spawned processes
(never forked: Lance and CUDA do not survive a fork); small ones in the calling thread, where a pool costs more than
it saves. This module imports only numpy and PIL, so a worker starts in well under a second.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image

POOL_MIN_BYTES = 4 << 20  # batches below this are encoded in the calling thread
ZLIB_DEFAULT = -1  # PIL's own default compress_level (zlib level 6)
_POOL: ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def encode_png(image_HWC: np.ndarray, compress_level: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image_HWC).save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def encode_many(images_BHWC: np.ndarray, compress_level: int) -> list[bytes]:
    """PNG bytes of each image, in this process (also a pool worker's task)."""
    return [encode_png(image, compress_level) for image in images_BHWC]


def encode_batch(images_BHWC: np.ndarray, compress_level: int) -> list[bytes]:
    """PNG bytes of each image of a uint8 (B, H, W, 3) batch, in order: in a process pool for large batches on a
    machine with cores to spare, else here."""
    workers = min(8, (os.cpu_count() or 1) // 2)
    if images_BHWC.nbytes < POOL_MIN_BYTES or workers < 2 or len(images_BHWC) < 2 * workers:
        return encode_many(images_BHWC, compress_level)
    parts = np.array_split(images_BHWC, workers)
    futures = [_pool(workers).submit(encode_many, part, compress_level) for part in parts]
    return [blob for future in futures for blob in future.result()]


def _pool(workers: int) -> ProcessPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
            atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
        return _POOL
