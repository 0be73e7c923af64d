"""Weight sync from the trainer to a rollout engine.

Colocated (the rollout samples with the trainer's own adapter object): the module is shared, so
there is nothing to copy -- only the policy version moves. Split (the rollout has its own adapter,
another device or process): the trainer exports the tensors that changed since the last export
(LoRA: only LoRA tensors; full fine-tuning: all weights) in size-bounded buckets, tagged with the
new version, and :func:`load_weights` applies them on the receiving side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from diffrl.engines.train.checkpoint import trainable_state
from diffrl.engines.train.setup import ADAPTER_NAME, add_lora, world

DEFAULT_BUCKET_BYTES = 512 * 2**20


@dataclass
class WeightBucket:
    """One message of a split weight sync: full tensors under the module's parameter names."""

    version: int
    tensors: dict[str, torch.Tensor]
    last: bool


def export_weights(
    trainer, *, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, only_changed: bool = True
) -> Iterator[WeightBucket]:
    """Buckets of the trainable tensors that differ from the previous export (all ranks must iterate it)."""
    state = trainable_state(trainer)
    changed = {
        k: v
        for k, v in state.items()
        if not only_changed or k not in trainer.last_exported or not torch.equal(trainer.last_exported[k], v)
    }
    if trainer.cfg.lora:  # small: remember what the receiver has, to send only changes next time
        trainer.last_exported = {k: v.clone() for k, v in state.items()}
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    names = list(changed)
    for i, name in enumerate(names):
        bucket[name] = changed[name]
        size += changed[name].numel() * changed[name].element_size()
        if size >= bucket_bytes or i == len(names) - 1:
            yield WeightBucket(version, bucket, last=i == len(names) - 1)
            bucket, size = {}, 0
    if not names:
        yield WeightBucket(version, {}, last=True)


def load_weights(adapter, bucket: WeightBucket, *, lora_cfg=None, targets: tuple[str, ...] | None = None) -> None:
    """Apply one bucket to a rollout-side adapter's denoiser (adds the same LoRA first if it lacks one)."""
    transformer = adapter.transformer
    if lora_cfg is not None and ADAPTER_NAME not in (getattr(transformer, "peft_config", None) or {}):
        add_lora(transformer, lora_cfg, targets or tuple(adapter.default_lora_targets))
        transformer.requires_grad_(False)
    params = dict(transformer.named_parameters())
    unknown = sorted(set(bucket.tensors) - set(params))
    if unknown:
        raise ValueError(
            f"weight sync: {len(unknown)} tensors have no parameter in the rollout's "
            f"{type(transformer).__name__}, e.g. {unknown[:3]}; trainer and rollout models differ"
        )
    with torch.no_grad():
        for name, value in bucket.tensors.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))


def sync_weights(trainer, rollout) -> dict[str, float]:
    """Bring `rollout` to the trainer's weights and bump the policy version; returns sync metrics."""
    started = time.perf_counter()
    num_tensors, num_bytes = 0, 0
    if rollout.adapter is not trainer.adapter:
        for bucket in export_weights(trainer, version=trainer.policy_version + 1):
            if world()[0] == 0 or world()[1] == 1:
                load_weights(
                    rollout.adapter,
                    bucket,
                    lora_cfg=trainer.cfg if trainer.cfg.lora else None,
                    targets=trainer.cfg.lora_targets,
                )
            num_tensors += len(bucket.tensors)
            num_bytes += sum(t.numel() * t.element_size() for t in bucket.tensors.values())
    trainer.mark_synced()
    return {
        "timing_s/sync_weights": time.perf_counter() - started,
        "sync/num_tensors": float(num_tensors),
        "sync/bytes": float(num_bytes),
        "sync/policy_version": float(trainer.policy_version),
    }
