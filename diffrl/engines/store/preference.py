"""Offline preference data for Diffusion-DPO: the dataset format, a generated toy set, and the latent cache.

Legend: P preference pairs, S the adapter's per-sample latent shape, H/W image height/width.

A preference dataset is a parquet file with one row per pair:
    prompt                       str
    chosen, rejected             the images: PNG/JPEG bytes or a path (str) to an image file
    chosen_latents, rejected_latents   (optional, instead of the images) nested lists of floats of
                                 the adapter's per-sample latent shape S (already VAE-encoded, scaled)
    uid                          (optional) a stable pair id; default: a hash of (row, prompt)
Images are resized to the run's resolution and encoded with the model's VAE **once**; the latents
(fp32) and the resized images (PNG) are cached in `runs/<name>/preferences.lance`, keyed by the pair
index, so a restarted run does not encode again and a crash mid-encode resumes where it stopped.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from diffrl.engines.store import fs
from diffrl.engines.store.png import ZLIB_DEFAULT, encode_png
from diffrl.engines.store.prompts import PromptDataset, PromptRecord, ocr_prompts, prompt_uid
from diffrl.engines.store.tables import LanceTable, first_rows, new_write_id, sql_in

_SCHEMA = pa.schema(
    [
        pa.field("pair", pa.int64()),
        pa.field("uid", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("fingerprint", pa.string()),
        pa.field("latents", pa.large_binary()),
        pa.field("chosen_image", pa.large_binary()),
        pa.field("rejected_image", pa.large_binary()),
        pa.field("write_id", pa.string()),
    ]
)
_ENCODE_BATCH = 8  # pairs per VAE forward (and per Lance commit)


# --------------------------------------------------------------------------------- the dataset
def _uids(table: pa.Table) -> list[str]:
    prompts = table.column("prompt").to_pylist()
    if "uid" in table.column_names:
        return [str(u) for u in table.column("uid").to_pylist()]
    return [prompt_uid(i, p) for i, p in enumerate(prompts)]


def preference_prompts(path: str, *, storage_options: dict | None = None) -> PromptDataset:
    """The pairs of a preference parquet as PromptRecords (uid = pair uid, metadata["pair"] = row index).

    Reads only the prompt (and uid) columns, so a large image dataset is not loaded here.
    """
    columns = _columns(path, storage_options)
    with fs.open(path, "rb", storage_options) as f:
        table = pq.read_table(f, columns=columns[:-2])
    if table.num_rows == 0:
        raise ValueError(f"data.train {path!r}: the preference dataset is empty")
    prompts = table.column("prompt").to_pylist()
    return PromptDataset(
        [PromptRecord(uid=u, prompt=p, metadata={"pair": i}) for i, (u, p) in enumerate(zip(_uids(table), prompts))],
        source=path,
    )


def _columns(path: str, storage_options: dict | None) -> list[str]:
    """The columns to read: prompt, [uid], then the two image (or latent) columns; ValueError if missing."""
    if not str(path).lower().endswith(".parquet"):
        raise ValueError(
            f"data.train {path!r}: an offline preference dataset must be a .parquet file "
            "(columns prompt, chosen, rejected or chosen_latents, rejected_latents)"
        )
    if not fs.exists(path, storage_options):
        raise ValueError(f"data.train {path!r}: preference file does not exist")
    with fs.open(path, "rb", storage_options) as f:
        names = set(pq.read_schema(f).names)
    has_images = {"chosen", "rejected"} <= names
    has_latents = {"chosen_latents", "rejected_latents"} <= names
    if "prompt" not in names or not (has_images or has_latents):
        raise ValueError(
            f"data.train {path!r}: a preference parquet needs a 'prompt' column and either "
            f"'chosen' and 'rejected' (image bytes or paths) or 'chosen_latents' and "
            f"'rejected_latents'; it has {sorted(names)}"
        )
    pair = ["chosen_latents", "rejected_latents"] if has_latents else ["chosen", "rejected"]
    return ["prompt"] + ["uid"] * ("uid" in names) + pair


def load_image(value, base_dir: str) -> Image.Image:
    """PNG/JPEG bytes or a path (relative paths are relative to the parquet's folder)."""
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value)).convert("RGB")
    if isinstance(value, str):
        path = value if os.path.isabs(value) or "://" in value else os.path.join(base_dir, value)
        with fs.open(path, "rb") as f:
            return Image.open(io.BytesIO(f.read())).convert("RGB")
    raise ValueError(f"preference image must be image bytes or a path string, got {type(value).__name__}")


def to_uint8(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """(H, W, 3) uint8 at the run's resolution (bicubic resize when the size differs)."""
    if image.size != (width, height):
        image = image.resize((width, height), Image.BICUBIC)
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy())


def write_toy_preferences(path: str, num_pairs: int, *, size: int = 32, seed: int = 0) -> str:
    """A small preference set for tests: chosen = flat colour images, rejected = the same colour plus
    strong pixel noise, so a compressibility reward (jpeg) agrees with every label. OCR prompts."""
    rng = np.random.default_rng(seed)
    prompts = ocr_prompts(num_pairs, seed=seed)
    chosen, rejected = [], []
    for _ in range(num_pairs):
        colour = rng.integers(40, 216, size=3)
        flat = np.broadcast_to(colour, (size, size, 3)).astype(np.int64)
        noisy = np.clip(flat + rng.normal(0.0, 60.0, size=(size, size, 3)), 0, 255)
        chosen.append(encode_png(flat.astype(np.uint8), ZLIB_DEFAULT))
        rejected.append(encode_png(noisy.astype(np.uint8), ZLIB_DEFAULT))
    table = pa.table(
        {
            "prompt": [r.prompt for r in prompts.records],
            "uid": [r.uid for r in prompts.records],
            "chosen": pa.array(chosen, pa.binary()),
            "rejected": pa.array(rejected, pa.binary()),
        }
    )
    pq.write_table(table, path)
    return path


# --------------------------------------------------------------------------------- VAE encoding
@torch.no_grad()
def vae_encode(adapter, images_BHWC: torch.Tensor, shape) -> torch.Tensor:
    """uint8 images (B, H, W, 3) -> latents (B, *S) fp32 in the adapter's layout, the inverse of decode.

    Uses `adapter.encode_images(images, shape)` when the adapter has one; otherwise handles adapters
    whose latents are an unpacked AutoencoderKL latent (C, h, w) scaled as (z - shift) * scale
    (SD3/SD3.5). The latent distribution's mode is used, so the cache is deterministic.
    """
    if hasattr(adapter, "encode_images"):
        return adapter.encode_images(images_BHWC, shape).float()
    vae = adapter.pipe.vae
    expected = latent_shape(adapter, shape)
    channels = getattr(vae.config, "latent_channels", None)
    if type(vae).__name__ != "AutoencoderKL" or len(expected) != 3 or expected[0] != channels:
        raise ValueError(
            f"offline DPO cannot VAE-encode images for {type(adapter).__name__} (latents {expected}, "
            f"VAE {type(vae).__name__}): give chosen_latents/rejected_latents in the dataset instead"
        )
    x = images_BHWC.permute(0, 3, 1, 2).to(adapter.device, adapter.dtype) / 127.5 - 1.0  # [-1, 1] as upstream
    z = vae.encode(x).latent_dist.mode()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((z.float() - shift) * vae.config.scaling_factor).cpu()


# --------------------------------------------------------------------------------- the cache
class PreferenceCache:
    """VAE latents of every pair of a preference dataset, in a Lance table (one row per pair)."""

    def __init__(self, uri: str, *, storage_options: dict | None = None):
        self.table = LanceTable(uri, storage_options=storage_options)
        self.table.dataset()  # a corrupt table fails here, naming its path

    def _stored(self, columns: list[str], pairs: list[int] | None = None) -> pa.Table:
        where = None if pairs is None else sql_in("pair", pairs)
        rows = self.table.scan(["pair", *[c for c in columns if c != "pair"], "write_id"], filter=where)
        if rows is None:
            return _SCHEMA.empty_table().select(["pair", *[c for c in columns if c != "pair"]])
        return first_rows(rows, ["pair"])  # a raced duplicate batch: the first commit wins

    def build(self, path: str, adapter, shape, *, fingerprint: str, storage_options: dict | None = None) -> int:
        """Encode the pairs of `path` not cached yet (all of them the first time); returns how many were encoded.

        `fingerprint` names the model and resolution; a cache built for another one is a ValueError.
        """
        done = self._stored(["fingerprint"])
        others = sorted(set(done.column("fingerprint").to_pylist()) - {fingerprint})
        if others:
            raise ValueError(
                f"{self.table.uri} caches latents of another model or resolution ({others[0]!r}, "
                f"now {fingerprint!r}): use a new run.name or delete that table"
            )
        have = set(done.column("pair").to_pylist())
        records = preference_prompts(path, storage_options=storage_options).records
        encoded, start = 0, 0
        columns = _columns(path, storage_options)
        with fs.open(path, "rb", storage_options) as f:  # streamed: a large image set is never loaded whole
            for part in pq.ParquetFile(f).iter_batches(batch_size=_ENCODE_BATCH, columns=columns):
                todo = [k for k in range(part.num_rows) if start + k not in have]
                if todo:
                    rows = pa.Table.from_batches([part]).take(pa.array(todo))
                    pairs = [start + k for k in todo]
                    self._encode_batch(
                        rows, pairs, [records[i] for i in pairs], adapter, shape, fingerprint, fs.parent(path)
                    )
                    encoded += len(todo)
                start += part.num_rows
        return encoded

    def _encode_batch(
        self,
        rows: pa.Table,
        batch: list[int],
        records: list[PromptRecord],
        adapter,
        shape,
        fingerprint: str,
        base_dir: str,
    ) -> None:
        latents, images = _latents_and_images(rows, adapter, shape, base_dir)
        write_id = new_write_id()
        self.table.append(
            pa.Table.from_pydict(
                {
                    "pair": batch,
                    "uid": [r.uid for r in records],
                    "prompt": [r.prompt for r in records],
                    "fingerprint": [fingerprint] * len(batch),
                    "latents": [save_tensors({"latents": latents[k].contiguous()}) for k in range(len(batch))],
                    "chosen_image": [encode_png(images[k, 0].numpy(), ZLIB_DEFAULT) for k in range(len(batch))],
                    "rejected_image": [encode_png(images[k, 1].numpy(), ZLIB_DEFAULT) for k in range(len(batch))],
                    "write_id": [write_id] * len(batch),
                },
                schema=_SCHEMA,
            )
        )

    def read(self, pairs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents (P, 2, *S) fp32 [chosen, rejected], images (P, 2, H, W, 3) uint8) in the order of `pairs`."""
        rows = self._stored(["latents", "chosen_image", "rejected_image"], pairs)
        position = {p: k for k, p in enumerate(rows.column("pair").to_pylist())}
        missing = [p for p in pairs if p not in position]
        if missing:
            raise ValueError(f"{self.table.uri}: pairs {missing[:5]} are not cached; build the cache first")
        blobs = rows.column("latents").to_pylist()
        chosen, rejected = rows.column("chosen_image").to_pylist(), rows.column("rejected_image").to_pylist()
        latents = torch.stack([load_tensors(blobs[position[p]])["latents"] for p in pairs])
        images = torch.stack(
            [torch.stack([_decode_png(chosen[position[p]]), _decode_png(rejected[position[p]])]) for p in pairs]
        )
        return latents, images

    def __len__(self) -> int:
        return self._stored([]).num_rows


def _latents_and_images(rows: pa.Table, adapter, shape, base_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents (P, 2, *S) fp32, images (P, 2, H, W, 3) uint8) of parquet rows: images are VAE-encoded;
    given latents are checked and decoded (for the images the run logs)."""
    expected = latent_shape(adapter, shape)
    if "chosen_latents" in rows.column_names:
        latents = torch.stack(
            [
                torch.tensor([c, r], dtype=torch.float32)
                for c, r in zip(rows.column("chosen_latents").to_pylist(), rows.column("rejected_latents").to_pylist())
            ]
        )
        if tuple(latents.shape[2:]) != expected:
            raise ValueError(
                f"preference latents have shape {tuple(latents.shape[2:])}; the model at "
                f"{shape.height}x{shape.width} needs {expected}"
            )
        images = adapter.decode(latents.flatten(0, 1).to(adapter.device), shape).cpu()
        return latents, images.reshape(len(latents), 2, *images.shape[1:])
    images = torch.stack(
        [
            torch.stack([to_uint8(load_image(v, base_dir), shape.height, shape.width) for v in (c, r)])
            for c, r in zip(rows.column("chosen").to_pylist(), rows.column("rejected").to_pylist())
        ]
    )
    encoded = vae_encode(adapter, images.flatten(0, 1), shape)
    return encoded.reshape(len(images), 2, *expected), images


def latent_shape(adapter, shape) -> tuple[int, ...]:
    """The adapter's per-sample latent shape S at `shape`."""
    return tuple(adapter.prepare_latents(shape, [torch.Generator().manual_seed(0)]).shape[1:])


def _decode_png(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.uint8).copy())
