"""Offline preference data: VAE encoding as diffusers does it, the latent cache (built once, resumable,
same latents from bytes or paths), the toy set agreeing with the jpeg reward, clear errors."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from diffrl.engines.reward.base import build_reward
from diffrl.engines.store.preference import (
    PreferenceCache,
    latent_shape,
    preference_prompts,
    vae_encode,
    write_toy_preferences,
)
from diffrl.models.base import SampleShape, load_adapter

SHAPE = SampleShape(32, 32)


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return load_adapter(tiny_model("sd3"))


def _images(path: str) -> tuple[list[bytes], list[bytes]]:
    table = pq.read_table(path)
    return table.column("chosen").to_pylist(), table.column("rejected").to_pylist()


def _uint8(png: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.uint8).copy())


def test_vae_encode_matches_diffusers_preprocess_and_encode(adapter):
    images = torch.randint(0, 256, (2, 32, 32, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    pipe = adapter.pipe
    x = pipe.image_processor.preprocess([Image.fromarray(im.numpy()) for im in images])
    with torch.no_grad():
        z = pipe.vae.encode(x).latent_dist.mode()
    expected = (z - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    ours = vae_encode(adapter, images, SHAPE)
    assert ours.shape == (2, *latent_shape(adapter, SHAPE))
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_toy_preferences_agree_with_the_jpeg_reward(tmp_path):
    path = write_toy_preferences(str(tmp_path / "prefs.parquet"), 6, size=32, seed=3)
    chosen, rejected = _images(path)
    jpeg = build_reward("jpeg_compressibility")
    stack = lambda pngs: torch.stack([_uint8(p) for p in pngs])  # noqa: E731
    good = jpeg(stack(chosen), [""] * 6, [{}] * 6).scores
    bad = jpeg(stack(rejected), [""] * 6, [{}] * 6).scores
    assert (good > bad).all()
    assert [r.metadata["pair"] for r in preference_prompts(path).records] == list(range(6))


def test_cache_encodes_once_and_reads_in_the_asked_order(tmp_path, adapter):
    path = write_toy_preferences(str(tmp_path / "prefs.parquet"), 10, size=32)  # > one encode batch of 8
    cache = PreferenceCache(str(tmp_path / "preferences.lance"))
    assert cache.build(path, adapter, SHAPE, fingerprint="m") == 10
    assert cache.build(path, adapter, SHAPE, fingerprint="m") == 0 and len(cache) == 10
    latents, images = cache.read([9, 0])
    chosen, rejected = _images(path)
    expected = torch.stack([_uint8(chosen[9]), _uint8(rejected[9])])
    assert torch.equal(images[0], expected)
    torch.testing.assert_close(latents[0], vae_encode(adapter, expected, SHAPE))
    with pytest.raises(ValueError, match="another model or resolution"):
        cache.build(path, adapter, SHAPE, fingerprint="other")


def test_image_paths_and_latent_columns_are_accepted(tmp_path, adapter):
    toy = write_toy_preferences(str(tmp_path / "toy.parquet"), 2, size=32)
    chosen, rejected = _images(toy)
    for i, png in enumerate(chosen + rejected):
        (tmp_path / f"{i}.png").write_bytes(png)
    prompts = pq.read_table(toy).column("prompt").to_pylist()
    by_path = str(tmp_path / "paths.parquet")
    pq.write_table(pa.table({"prompt": prompts, "chosen": ["0.png", "1.png"], "rejected": ["2.png", "3.png"]}), by_path)
    a, b = PreferenceCache(str(tmp_path / "a.lance")), PreferenceCache(str(tmp_path / "b.lance"))
    a.build(toy, adapter, SHAPE, fingerprint="m")
    b.build(by_path, adapter, SHAPE, fingerprint="m")
    torch.testing.assert_close(a.read([0, 1])[0], b.read([0, 1])[0])
    given = torch.randn(2, 2, *latent_shape(adapter, SHAPE), generator=torch.Generator().manual_seed(1))
    by_latents = str(tmp_path / "latents.parquet")
    pq.write_table(
        pa.table({"prompt": prompts, "chosen_latents": given[:, 0].tolist(), "rejected_latents": given[:, 1].tolist()}),
        by_latents,
    )
    c = PreferenceCache(str(tmp_path / "c.lance"))
    c.build(by_latents, adapter, SHAPE, fingerprint="m")
    assert torch.equal(c.read([0, 1])[0], given)


def test_a_parquet_without_preference_columns_is_a_clear_error(tmp_path):
    path = str(tmp_path / "prompts.parquet")
    pq.write_table(pa.table({"prompt": ["a cat"], "image": [b""]}), path)
    with pytest.raises(ValueError, match="'chosen' and 'rejected'"):
        preference_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        preference_prompts(os.path.join(str(tmp_path), "missing.parquet"))
