"""Trajectories <-> Arrow rows of the trajectory table (schema version 1).

Legend: B samples, W window steps, S per-sample latent shape, F frames, H/W image height/width.
One row per sample. Tensors become fixed-size columns so a step reads back as contiguous buffers
(no per-row Python work for tensors): latents are an Arrow `fixed_shape_tensor` of shape
(W + 1, *S) float32, per-step values (log_probs, sigmas, sigmas_prev, trained) fixed-size lists
of length W. Images are PNG bytes in a Lance blob column; a video is one PNG of its F frames
stacked vertically (a lossless filmstrip, `num_frames` = F; 0 for a still image). An audio-only model's rows have no
image (null). A model that makes audio has two more columns: `audio`, each sample's waveform as the bytes of a
16-bit PCM WAV file (its channels and sample rate in the WAV header; diffrl/models/wav.py) in a blob column, and
`fps`, the frames per second of the video that audio accompanies (null for audio alone).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from PIL import Image

from diffrl.engines.store.png import encode_batch
from diffrl.engines.trajectories import Trajectories, no_frames
from diffrl.models.wav import decode_wav, encode_wav

SCHEMA_VERSION = "1"
META_SCHEMA_VERSION = "diffrl.schema_version"
META_LATENT_SHAPE = "diffrl.latent_shape"
META_LATENT_DTYPE = "diffrl.latent_dtype"
KEY_COLUMNS = ["chunk", "chunk_row", "group_id", "sample_index", "write_id"]
SMALL_COLUMNS = [
    "run",
    "step",
    "chunk",
    "chunk_row",
    "group_id",
    "sample_index",
    "prompt",
    "seed",
    "window_start",
    "has_latents",
    "log_probs",
    "sigmas",
    "sigmas_prev",
    "trained",
    "num_frames",
    "embed_key",
    "metadata",
    "policy_version",
    "write_id",
]
_PER_STEP = ("log_probs", "sigmas", "sigmas_prev")
DIGESTED = ("latents", "log_probs")  # the columns a resumed step trains on, each with a digest per row
AUDIO_COLUMNS = ["audio", "fps"]  # the columns of a model that makes audio (read with the images)


def digest_column(name: str) -> str:
    """The column holding the per-row digests of column `name` ("log_probs" -> "log_probs_digest")."""
    return f"{name}_digest"


def row_digests(values_BN: np.ndarray) -> pa.Array:
    """One digest per row of a (B, N) float32 array: SHA-256 of the row's bytes, as hex (SHA-256 rather than BLAKE2b:
    about twice as fast where the CPU has SHA instructions; hashlib releases the GIL while it hashes a row)."""
    rows = np.ascontiguousarray(values_BN, dtype=np.float32).reshape(len(values_BN), -1)
    return pa.array([hashlib.sha256(row.data).hexdigest() for row in rows], pa.string())


def trajectory_schema(latent_shape: tuple[int, ...], *, audio: bool = False) -> pa.Schema:
    """The table schema for latents of shape (W + 1, *S); the shape also goes in the metadata. `audio`: with the
    audio columns (AUDIO_COLUMNS) of a model that makes audio."""
    window = latent_shape[0] - 1
    step_f32 = pa.list_(pa.float32(), window)
    fields = [
        pa.field("run", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("chunk", pa.int64()),
        pa.field("chunk_row", pa.int64()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("prompt", pa.string()),
        pa.field("seed", pa.int64()),
        pa.field("window_start", pa.int64()),
        # Nullable: retention (drop_latents) nulls old steps' latents; has_latents makes that cheap to query.
        pa.field("latents", pa.fixed_shape_tensor(pa.float32(), list(latent_shape))),
        pa.field("has_latents", pa.bool_()),
        pa.field("log_probs", step_f32),
        pa.field("sigmas", step_f32),
        pa.field("sigmas_prev", step_f32),
        pa.field("trained", pa.list_(pa.bool_(), window)),
        pa.field("image", pa.large_binary(), metadata={"lance-encoding:blob": "true"}),
        pa.field("num_frames", pa.int32()),
        pa.field("embed_key", pa.string()),
        pa.field("metadata", pa.string()),
        pa.field("policy_version", pa.int64()),
        pa.field("write_id", pa.string()),
        # what the row's latents and log-probs were when written (row_digests): a resume checks them
        *[pa.field(digest_column(name), pa.string()) for name in DIGESTED],
    ]
    if audio:
        fields += [
            pa.field("audio", pa.large_binary(), metadata={"lance-encoding:blob": "true"}),
            pa.field("fps", pa.float64()),
        ]
    meta = {
        META_SCHEMA_VERSION: SCHEMA_VERSION,
        META_LATENT_SHAPE: json.dumps(list(latent_shape)),
        META_LATENT_DTYPE: "float32",
    }
    return pa.schema(fields, metadata=meta)


def _fixed_list(x: torch.Tensor, arrow_type: pa.DataType) -> pa.Array:
    """(B, *shape) tensor -> fixed-size list array of B rows (zero-copy from the CPU buffer)."""
    flat = x.detach().cpu().contiguous().reshape(-1).numpy()
    width = int(np.prod(x.shape[1:], dtype=np.int64))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, type=arrow_type), width)


def encode_images(images: torch.Tensor, compress_level: int = 1) -> tuple[list[bytes], int]:
    """(B, H, W, 3) or (B, F, H, W, 3) uint8 -> PNG bytes per sample and F (0 for images).

    compress_level 1: zlib's fastest level; higher levels save ~5% and cost several times more.
    """
    if images.dtype != torch.uint8 or images.ndim not in (4, 5) or images.shape[-1] != 3:
        raise ValueError(
            f"Trajectories.images: expected uint8 (B, H, W, 3) or (B, F, H, W, 3), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    arr = images.detach().cpu().contiguous().numpy()
    num_frames = 0
    if arr.ndim == 5:  # video: stack frames vertically into one filmstrip image
        num_frames = arr.shape[1]
        arr = arr.reshape(arr.shape[0], arr.shape[1] * arr.shape[2], arr.shape[3], 3)
    return encode_batch(arr, compress_level), num_frames


def decode_image(blob: bytes) -> Image.Image:
    """PNG bytes of one stored sample -> PIL image (a video comes back as its filmstrip)."""
    return Image.open(io.BytesIO(blob)).convert("RGB")


def decode_images(blobs: list[bytes], num_frames: int) -> torch.Tensor:
    """PNG bytes -> (B, H, W, 3) uint8, or (B, F, H, W, 3) when num_frames > 0."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        arrays = list(pool.map(lambda b: np.asarray(decode_image(b)), blobs))
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(
            f"stored images of one read have different shapes {sorted(shapes)}; "
            "read them one by one with TrajectoryStore.image()"
        )
    out = torch.from_numpy(np.stack(arrays))
    if num_frames > 0:
        b, fh, w, c = out.shape
        out = out.reshape(b, num_frames, fh // num_frames, w, c)
    return out


def to_arrow(
    traj: Trajectories, *, run: str, step: int, chunk: int, write_id: str, compress_level: int = 1
) -> pa.Table:
    """One chunk of samples as rows of the trajectory table."""
    b = len(traj)
    latent_shape = tuple(traj.latents.shape[1:])
    schema = trajectory_schema(latent_shape, audio=traj.audio is not None)
    # an audio-only model's images are (B, 0, 0, 3): no frames, a null image
    blobs, num_frames = encode_images(traj.images, compress_level) if traj.images.numel() else ([None] * b, 0)
    for name in ("sample_index", "seeds", "window_starts"):
        if getattr(traj, name).shape != (b,):
            raise ValueError(f"Trajectories.{name}: expected shape ({b},), got {tuple(getattr(traj, name).shape)}")
    for name in (*_PER_STEP, "trained"):
        if getattr(traj, name).shape != (b, traj.window_size):
            raise ValueError(
                f"Trajectories.{name}: expected shape ({b}, {traj.window_size}), got {tuple(getattr(traj, name).shape)}"
            )
    if not (len(traj.group_ids) == len(traj.embed_keys) == len(traj.metadata) == b):
        raise ValueError("Trajectories: prompts, group_ids, embed_keys and metadata must all have B entries")
    latents = pa.ExtensionArray.from_storage(schema.field("latents").type, _fixed_list(traj.latents, pa.float32()))
    log_probs = traj.log_probs.detach().cpu().to(torch.float32)
    ints = lambda x: pa.array(x.detach().cpu().to(torch.int64).numpy())  # noqa: E731
    columns = {
        "run": pa.array([run] * b, pa.string()),
        "step": pa.array(np.full(b, step, np.int64)),
        "chunk": pa.array(np.full(b, chunk, np.int64)),
        "chunk_row": pa.array(np.arange(b, dtype=np.int64)),
        "group_id": pa.array([str(g) for g in traj.group_ids], pa.string()),
        "sample_index": ints(traj.sample_index),
        "prompt": pa.array(traj.prompts, pa.string()),
        "seed": ints(traj.seeds),
        "window_start": ints(traj.window_starts),
        "latents": latents,
        "has_latents": pa.array(np.ones(b, bool)),
        **{n: _fixed_list(getattr(traj, n).to(torch.float32), pa.float32()) for n in _PER_STEP},
        "trained": _fixed_list(traj.trained.to(torch.bool), pa.bool_()),
        "image": pa.array(blobs, pa.large_binary()),
        "num_frames": pa.array(np.full(b, num_frames, np.int32)),
        "embed_key": pa.array(traj.embed_keys, pa.string()),
        "metadata": pa.array([json.dumps(m, sort_keys=True) for m in traj.metadata], pa.string()),
        "policy_version": pa.array(np.full(b, traj.policy_version, np.int64)),
        "write_id": pa.array([write_id] * b, pa.string()),
        "latents_digest": row_digests(traj.latents.detach().cpu().reshape(b, -1).numpy()),
        "log_probs_digest": row_digests(log_probs.numpy()),
    }
    if traj.audio is not None:
        waveforms = traj.audio.detach().cpu().numpy()
        columns["audio"] = pa.array([encode_wav(w, traj.sample_rate) for w in waveforms], pa.large_binary())
        columns["fps"] = pa.array([traj.fps] * b, pa.float64())
    return pa.Table.from_pydict(columns, schema=schema)


def decode_audio_column(blobs: list[bytes]) -> tuple[torch.Tensor, int]:
    """WAV bytes of one read -> (waveforms (B, C, T) float32, sample rate)."""
    decoded = [decode_wav(blob) for blob in blobs]
    formats = {(w.shape, rate) for w, rate in decoded}
    if len(formats) != 1:
        raise ValueError(f"stored audio of one read differs in (shape, sample rate): {sorted(formats)}")
    return torch.from_numpy(np.stack([w for w, _ in decoded])), decoded[0][1]


def column_to_tensor(
    column: pa.ChunkedArray, dest: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Fixed-size column (scan order) -> tensor (n, *shape) with scan row j written at dest[j].

    One copy per Arrow chunk straight into the output: the permutation to (chunk, row) order is
    applied while copying instead of with a separate take over the (large) latents buffer.
    """
    n = len(dest)
    out = torch.empty((n, *shape), dtype=dtype)
    flat = out.view(n, -1).numpy()
    start = 0
    for piece in column.chunks:
        storage = piece.storage if isinstance(piece, pa.ExtensionArray) else piece
        if storage.null_count:
            raise AssertionError("column_to_tensor: null rows must be rejected by the caller")
        m = len(storage)
        values = storage.flatten().to_numpy(zero_copy_only=False)
        flat[dest[start : start + m]] = values.reshape(m, -1)
        start += m
    return out


def from_arrow(
    table: pa.Table, order: np.ndarray, latent_shape: tuple[int, ...], *, with_latents: bool, with_images: bool
) -> Trajectories:
    """Rows of one read (scan order) -> Trajectories in the order `order` (scan positions)."""
    n = len(order)
    dest = np.empty(n, dtype=np.int64)
    dest[order] = np.arange(n)
    window = latent_shape[0] - 1
    small = table.select([c for c in SMALL_COLUMNS if c in table.column_names]).take(pa.array(order))
    as_np = lambda name: small.column(name).to_numpy()  # noqa: E731
    if with_latents:
        latents = column_to_tensor(table.column("latents"), dest, latent_shape, torch.float32)
    else:  # zero-size trailing dim: shape-checks downstream fail loudly instead of training on zeros
        latents = torch.empty((n, window + 1, 0), dtype=torch.float32)
    per_step = {c: column_to_tensor(table.column(c), dest, (window,), torch.float32) for c in _PER_STEP}
    trained = column_to_tensor(table.column("trained"), dest, (window,), torch.bool)
    audio, sample_rate, fps = None, 0, None
    if with_images:
        frames = set(as_np("num_frames").tolist())
        if len(frames) != 1:
            raise ValueError(f"stored samples of one read mix videos and images (num_frames {sorted(frames)})")
        blobs = table.column("image").take(pa.array(order)).to_pylist()
        images = no_frames(n) if all(blob is None for blob in blobs) else decode_images(blobs, frames.pop())
        if "audio" in table.column_names:
            audio, sample_rate = decode_audio_column(table.column("audio").take(pa.array(order)).to_pylist())
            fps = table.column("fps")[0].as_py() if n else None
    else:
        images = no_frames(n)
    return Trajectories(
        prompts=small.column("prompt").to_pylist(),
        group_ids=small.column("group_id").to_pylist(),
        sample_index=torch.from_numpy(as_np("sample_index").copy()),
        seeds=torch.from_numpy(as_np("seed").copy()),
        latents=latents,
        log_probs=per_step["log_probs"],
        sigmas=per_step["sigmas"],
        sigmas_prev=per_step["sigmas_prev"],
        window_starts=torch.from_numpy(as_np("window_start").copy()),
        trained=trained,
        images=images,
        embed_keys=small.column("embed_key").to_pylist(),
        metadata=[json.loads(m) for m in small.column("metadata").to_pylist()],
        policy_version=int(as_np("policy_version").min()),
        audio=audio,
        sample_rate=sample_rate,
        fps=fps,
    )


def first_altered(rows: pa.Table, name: str) -> tuple[str, int] | None:
    """(group_id, sample_index) of the first of `rows` whose column `name` no longer matches the digest written with it
    (rows without a value or a digest, such as latents dropped by retention, are not checked); None when every row
    matches."""
    checked = rows.filter(pc.and_(pc.is_valid(rows.column(name)), pc.is_valid(rows.column(digest_column(name)))))
    if checked.num_rows == 0:
        return None
    values = checked.column(name).combine_chunks()
    storage = values.storage if isinstance(values, pa.ExtensionArray) else values
    now = row_digests(storage.flatten().to_numpy(zero_copy_only=False).reshape(checked.num_rows, -1))
    differ = pc.not_equal(now, checked.column(digest_column(name)).combine_chunks())
    if not pc.any(differ).as_py():
        return None
    first = pc.index(differ, True).as_py()
    return checked.column("group_id")[first].as_py(), checked.column("sample_index")[first].as_py()
