"""A run's disk, kept bounded: old steps' latents dropped (`run.keep_latents_steps`), the per-append Lance fragments
merged every `run.compact_every` steps, and the estimate `diffrl train` prints after its first step.

Latents are the bulk of a step (fp32, every stored denoising state of every sample: 320 KB per 64x64 sample of
the shapes recipe, 768 KB per 512x512 Qwen-Image sample); the update needs them only until its step's checkpoint
commits, and a resume only for the step in flight. Rows, prompts, seeds, log-probs, rewards, advantages and
images always stay.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from diffrl.algorithms.windows import sample_windows
from diffrl.engines.handle import Engines
from diffrl.engines.numbering import counted, step_number
from diffrl.engines.train.setup import trained_module
from diffrl.models.base import SampleShape

# Versions older than this go after a compaction: the previous compaction's copies, not the one a reader may be on
# (a read takes well under this; at 60 s a 2 s step kept ~30 steps of dropped latents on disk).
KEEP_VERSIONS_S = 10.0
ROW_BYTES = 1024  # prompt, keys, log-probs, sigmas, metadata of one row (an upper estimate)


def retain(engines: Engines, step: int) -> None:
    """After step `step` is done: every run.compact_every steps, drop latents older than run.keep_latents_steps,
    merge fragments and delete old versions (every step's drop when compact_every is 0). Queued on the background
    writer (after the step's checkpoint), which hands it to the janitor (runs where the engines live: this process, or
    the first Ray replica)."""
    run = engines.config.run
    compact = bool(run.compact_every) and (step + 1) % run.compact_every == 0
    memory = engines.memory
    if engines.store is None:
        return
    what = f"retention after step {step_number(step)}"
    # In order behind the step's writes, then on the janitor (its own Lance handles: appends of the next steps commit
    # beside its rewrite and merge): a compaction takes 5-6 s on the shapes recipe on an H200, and the update, which
    # waits for the writer, would wait for it
    store = engines.store
    args = (
        type(store),
        store.uri,
        run.storage_options or None,
        run.keep_latents_steps,
        step,
        compact,
        run.compact_every,
    )
    memory.writer.submit(step, what, memory.janitor.submit, step, what, _retain_apart, *args)
    if compact:
        memory.writer.submit(step, "embedding cache compaction", compact_embeddings, engines)


def _retain_apart(kind: type, uri: str, storage_options: dict | None, *args: Any) -> None:
    """_retain on a store handle of its own (a Lance dataset handle is not shared between threads)."""
    _retain(kind(uri, storage_options=storage_options), *args)


def _retain(store: Any, keep_latents_steps: int, step: int, compact: bool, compact_every: int) -> None:
    # Dropping rewrites the rows it nulls: batched at compaction time (which frees the bytes) it is one rewrite
    # per compact_every steps instead of one per step; without compaction, every step.
    if keep_latents_steps >= 0 and (compact or not compact_every):
        store.drop_latents(keep_latents_steps, step)
    if compact:
        store.compact()
        store.cleanup(older_than_seconds=KEEP_VERSIONS_S)


def compact_embeddings(engines: Engines) -> None:
    """Merge the rollout's prompt-embedding cache, which gains a fragment for each step that meets new prompts
    (run where the rollout and its cache live: this process, or its Ray actor)."""
    cache = getattr(engines.rollout, "cache", None)  # a token rollout keeps none: its prompts are token ids
    if cache is not None:
        cache.compact()
        cache.table.cleanup(older_than_seconds=KEEP_VERSIONS_S)


def latent_numel(engines: Engines) -> int:
    """Elements of one sample's latent at the run's resolution (where the rollout's adapter lives)."""
    cfg = engines.config.rollout
    shape = SampleShape(cfg.height, cfg.width, cfg.num_frames, cfg.duration)
    return int(engines.adapter.prepare_latents(shape, [torch.Generator().manual_seed(0)])[0].numel())


def sample_noun(engines: Engines) -> str:
    """What the run's samples are, as its model makes them (where the rollout's adapter lives): images, videos (frames,
    with or without sound) or clips (sound alone)."""
    adapter = engines.adapter
    if not adapter.visual:
        return "clips"
    return "videos" if adapter.is_video else "images"


def checkpoint_bytes(engines: Engines) -> int:
    """About the bytes of one checkpoint of the run's trainer (where it lives), as diffrl/engines/train/checkpoint.py
    writes it. LoRA: every LoRA tensor (a frozen "old" adapter too) in trainable.safetensors, the trained ones again
    in the lora/ export, AdamW's two moments of the trained ones; full fine-tuning: every parameter and the moments."""
    trainer = engines.trainer
    trained = {id(p): p for group in trainer.optimizer.param_groups for p in group["params"]}.values()
    trained_bytes = sum(p.numel() * p.element_size() for p in trained)
    named = list(trained_module(trainer.adapter).named_parameters())
    if trainer.cfg.lora:
        kept = sum(p.numel() * p.element_size() for name, p in named if p.requires_grad or "lora_" in name)
        return kept + 3 * trained_bytes
    return sum(p.numel() * p.element_size() for _, p in named) + 2 * trained_bytes


def checkpoints_held(cfg: Any) -> int:
    """Checkpoints on disk at the end of a run: every checkpoint_every-th one and the latest two."""
    steps, every = cfg.run.steps, max(cfg.run.checkpoint_every, 1)
    return min(steps, steps // every + 2)


def stored_image_bytes(engines: Engines, step: int) -> float | None:
    """Mean bytes of one image of step `step` as stored (PNG), read behind the step's writes (where the rollout and
    its store live); None without a store."""
    if engines.store is None or engines.memory is None:
        return None
    return engines.memory.writer.call(step, "stored image sizes", engines.store.image_bytes, step)


def disk_estimate(
    cfg: Any, latent_elements: int, checkpoint: int = 0, image_bytes: float | None = None
) -> dict[str, float]:
    """Bytes a run writes: per step (latents, rows with images) and in all, with its retention and its checkpoints
    (`checkpoint` bytes each). An image counts `image_bytes` (what a step stored: PNG), else its raw size (an upper
    bound). Latents stay on disk for keep_latents_steps steps, the step in flight and up to compact_every more until
    a compaction frees the dropped ones. At the peak, a compaction has written its merged copy of the latents it
    keeps and drops before the files it replaces go, and a new checkpoint is written before the oldest kept one is
    removed."""
    samples, steps = cfg.rollout.samples_per_step, cfg.run.steps
    # the stored window: what the rollout keeps for this policy and number of steps (offline pairs keep one step)
    window = (
        sample_windows(cfg.algorithm.window, cfg.rollout.num_inference_steps, torch.zeros(1, dtype=torch.long), 0).size
        if cfg.data.sample_source == "online"
        else 1
    )
    latents = samples * (window + 1) * latent_elements * 4
    raw = cfg.rollout.height * cfg.rollout.width * 3 * max(cfg.rollout.num_frames, 1)
    rows = samples * (ROW_BYTES + (raw if image_bytes is None else image_bytes))
    keep, compact_every = cfg.run.keep_latents_steps, cfg.run.compact_every
    held = steps if keep < 0 else min(steps, keep + 1 + (compact_every or steps))
    tables = steps * rows + held * latents
    checkpoints = checkpoints_held(cfg) * checkpoint
    rewritten = min(steps, compact_every) * latents if compact_every else 0
    return {
        "latents_per_step": float(latents),
        "rows_per_step": float(rows),
        "checkpoints": float(checkpoints),
        "total": float(tables + checkpoints),
        "peak": float(tables + checkpoints + rewritten + (checkpoint if steps > checkpoints_held(cfg) else 0)),
        "latent_steps_held": float(held),
    }


def describe_disk(cfg: Any, latent_elements: int, checkpoint: int = 0, image_bytes: float | None = None) -> str:
    """One line for a run: what it will write (images at `image_bytes` each, what its first step stored) and what
    the disk has free."""
    est = disk_estimate(cfg, latent_elements, checkpoint, image_bytes)
    keep = cfg.run.keep_latents_steps
    kept = "every step's latents kept" if keep < 0 else f"latents of the last {counted(keep, 'step')} kept"
    images = "images at their raw size" if image_bytes is None else f"images of {_size(image_bytes)} as stored"
    line = (
        f"disk: about {_size(est['total'])} for {counted(cfg.run.steps, 'step')} ({kept}; per step "
        f"{_size(est['latents_per_step'])} of latents, {_size(est['rows_per_step'])} of rows and {images}"
    )
    if checkpoint:
        line += f"; {counted(checkpoints_held(cfg), 'checkpoint')} of {_size(checkpoint)} kept"
    line += f"), up to {_size(est['peak'])} while a compaction rewrites the tables"
    if "://" not in cfg.run.root:
        free = shutil.disk_usage(_existing(cfg.run.root)).free
        line += f"; {_size(free)} free"
        if free < est["peak"]:
            line += " -- NOT ENOUGH: lower run.keep_latents_steps, raise run.checkpoint_every or free space"
    return line


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
