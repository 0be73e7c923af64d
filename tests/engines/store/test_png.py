"""PNG encoding of image batches: the process pool gives the same bytes as encoding in the calling thread."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from diffrl.engines.store import png


def test_pool_and_in_thread_encodings_are_identical_and_lossless(monkeypatch):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 16, 24, 3), dtype=np.uint8)
    here = png.encode_batch(images, 1)  # below POOL_MIN_BYTES: in this thread
    monkeypatch.setattr(png, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(png.os, "cpu_count", lambda: 8)  # 4 spawned workers, also on the 2-core CI machine
    pooled = png.encode_batch(images, 1)
    assert png._POOL is not None  # the pool really ran
    assert pooled == here
    for blob, image in zip(pooled, images):
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(blob))), image)
