"""Weight sync from the trainer to a rollout engine.

Colocated (the rollout samples with the trainer's own adapter object): the module is shared, so
there is nothing to copy -- only the policy version moves. Split (the rollout has its own adapter,
another device or process): the trainer exports the tensors that changed since the last export
(LoRA: only LoRA tensors; full fine-tuning: all weights) in size-bounded buckets, tagged with the
new version, and :func:`load_weights` applies them on the receiving side. Engine replicas (`cluster.gpus` > 1)
training LoRA are colocated (each keeps whole parameters: nothing to copy); fully fine-tuned they shard the
denoiser with FSDP2 and each samples with an unsharded copy (:func:`rollout_copy`) in its process, which every rank
loads after each update (:func:`send_weights`). An asynchronous run (run.async) samples with a behaviour copy
(:func:`behaviour_copy`): the trainer's frozen base tensors, its own LoRA tensors (every adapter's: DiffusionNFT's EMA
"old" adapter, which its rollout samples with, too), loaded the same way at each sync. On engine replicas the
trainer's module is FSDP2-wrapped, so the copy is made before it is sharded, with placeholders for the frozen base
tensors, and pointed at the trainer's own tensors once it is (:func:`behaviour_frame`, :func:`bind_frozen`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from diffrl.engines.train.checkpoint import trainable_state
from diffrl.engines.train.setup import ADAPTER_NAME, add_lora, trained_module, world

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


def _ensure_lora(lora_cfg, targets: tuple[str, ...] | None, adapter) -> None:
    """Give a rollout's frozen copy of each denoiser (both Wan2.2 experts) the trained LoRA adapter if it has none yet
    (nothing when not training LoRA)."""
    if lora_cfg is None:
        return
    for transformer in adapter.denoisers():
        if ADAPTER_NAME not in (getattr(transformer, "peft_config", None) or {}):
            add_lora(transformer, lora_cfg, targets or tuple(adapter.default_lora_targets))
            transformer.requires_grad_(False)


def load_weights(adapter, bucket: WeightBucket, *, lora_cfg=None, targets: tuple[str, ...] | None = None) -> None:
    """Apply one bucket to a rollout-side adapter's denoiser (adds the same LoRA first if it lacks one)."""
    transformer = trained_module(adapter)
    _ensure_lora(lora_cfg, targets, adapter)
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


def rollout_copy(adapter):
    """A second adapter for a replica's rollout: the same text encoders, VAE and scheduler objects (no second copy of
    them) and its own copy of each denoiser, taken before the trainer adds LoRA and shards the original."""
    twin = copy.copy(adapter)
    twin.pipe = copy.copy(adapter.pipe)
    twin.pipe.transformer = copy.deepcopy(adapter.transformer)
    if getattr(adapter.pipe, "transformer_2", None) is not None:  # Wan2.2's low-noise expert
        twin.pipe.transformer_2 = copy.deepcopy(adapter.pipe.transformer_2)
    return twin


def behaviour_copy(adapter):
    """The behaviour policy of an asynchronous run (run.async): a second adapter whose trained modules share every
    frozen base tensor and buffer of `adapter`'s (the same storage: no second copy of the base weights) and own a copy
    of their LoRA tensors (every adapter's: the trained one and DiffusionNFT's frozen EMA "old" one, which the trainer
    changes in place after each update), taken after the trainer added LoRA. The rollout samples with it while the
    trainer updates its own adapter; each weight sync copies the LoRA tensors into it (:func:`send_weights`). A
    diffusion adapter's copy gets its own denoisers (both Wan2.2 experts) and the same text encoders, VAE and scheduler
    objects, as in :func:`rollout_copy`; a causal LM policy's (diffrl/models/causal_lm/policy.py) its own `model` and
    the same tokenizer and processors."""
    twin = copy.copy(adapter)
    if getattr(adapter, "kind", "diffusion") == "autoregressive":
        twin.model = _frozen_shared(adapter.model)
        return twin
    return _with_denoisers(twin, adapter, _frozen_shared)


def behaviour_frame(adapter):
    """The behaviour copy of an engine replica's asynchronous run, made after the trainer added LoRA and before FSDP2
    wraps the denoisers (a wrapped module cannot be copied): as :func:`behaviour_copy`, but each frozen parameter is a
    placeholder on the meta device (no memory) until :func:`bind_frozen` points it at the trainer's own tensor."""
    return _with_denoisers(copy.copy(adapter), adapter, _frozen_frame)


def _with_denoisers(twin, adapter, make):
    """`twin` (a shallow copy of a diffusion `adapter`) with its own pipeline object whose denoisers are `make` of
    `adapter`'s (both Wan2.2 experts); returns `twin`."""
    twin.pipe = copy.copy(adapter.pipe)
    for name in ("transformer", "transformer_2"):  # Wan2.2's low-noise expert too
        module = getattr(adapter.pipe, name, None)
        if module is not None:
            setattr(twin.pipe, name, make(module))
    return twin


def bind_frozen(twin, adapter):
    """Point every frozen placeholder of `twin` (:func:`behaviour_frame`) at the same tensor of `adapter`'s sharded
    denoisers, and its buffers at theirs; returns `twin`. A LoRA trainer of engine replicas keeps whole parameters
    (HSDP over a shard group of one: diffrl/engines/train/setup.shard), so each DTensor's local tensor is the whole
    tensor: the copy shares its storage, as the single-process copy does."""
    from torch.distributed.tensor import DTensor

    for name in ("transformer", "transformer_2"):
        mine = getattr(twin.pipe, name, None)
        if mine is None:
            continue
        theirs = getattr(adapter.pipe, name)
        trained = dict(theirs.named_parameters(remove_duplicate=False))
        for path, param in list(mine.named_parameters(remove_duplicate=False)):
            if not param.is_meta:
                continue
            source = trained[path]
            local = (source.to_local() if isinstance(source, DTensor) else source).detach()
            if local.shape != param.shape:
                raise ValueError(
                    f"the behaviour copy shares the trainer's whole frozen tensors, but {path} is sharded "
                    f"({tuple(local.shape)} of {tuple(param.shape)}): run.async needs the replicas to train LoRA"
                )
            owner, _, leaf = path.rpartition(".")
            mine.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(local, requires_grad=False)
        buffers = dict(theirs.named_buffers(remove_duplicate=False))
        for path, _ in list(mine.named_buffers(remove_duplicate=False)):
            owner, _, leaf = path.rpartition(".")
            mine.get_submodule(owner)._buffers[leaf] = buffers[path]
    return twin


def _frozen_frame(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `module` with meta placeholders for its frozen base parameters, copies of the parameters a
    weight sync sends (:func:`_synced`) and the same buffers."""
    memo = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for name, p in module.named_parameters()
        if not _synced(name, p)
    }
    memo.update({id(b): b for b in module.buffers()})
    return copy.deepcopy(module, memo=memo).requires_grad_(False)


def _frozen_shared(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `module` that holds the same frozen base parameters and buffers (not copies) and copies of
    the parameters a weight sync sends (:func:`_synced`)."""
    frozen = [p for name, p in module.named_parameters() if not _synced(name, p)] + list(module.buffers())
    copied = copy.deepcopy(module, memo={id(t): t for t in frozen})  # the memo makes deepcopy reuse them
    return copied.requires_grad_(False)


def _synced(name: str, param: torch.nn.Parameter) -> bool:
    """Whether a weight sync into a rollout's own copy sends this parameter: a trained one, or a frozen LoRA tensor
    (DiffusionNFT's "old" adapter: an EMA of the trained one, which its rollout samples with)."""
    return param.requires_grad or "lora_" in name


def send_weights(trainer, adapter) -> tuple[int, int]:
    """Copy the trainer's trainable tensors and LoRA tensors (:func:`_synced`) into `adapter`, a rollout's own copy of
    the denoiser in this process (adding the same LoRA first); returns (tensors, bytes) sent. Every rank of a sharded
    trainer gathers each tensor in turn (DTensor.full_tensor: one tensor's all-gather at a time, never the whole model)
    and loads its own copy."""
    _ensure_lora(trainer.cfg if trainer.cfg.lora else None, trainer.cfg.lora_targets, adapter)
    params = dict(trained_module(adapter).named_parameters())
    num_tensors, num_bytes = 0, 0
    with torch.no_grad():
        for name, param in trained_module(trainer.adapter).named_parameters():
            if not _synced(name, param):
                continue
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            params[name].copy_(full)
            num_tensors += 1
            num_bytes += full.numel() * full.element_size()
    return num_tensors, num_bytes


def sync_weights(trainer, rollout) -> dict[str, float]:
    """Bring `rollout` to the trainer's weights and bump the policy version; returns sync metrics."""
    started = time.perf_counter()
    num_tensors, num_bytes = 0, 0
    if rollout.adapter is trainer.rollout_copy:  # a replica's own copy: each rank loads its own
        num_tensors, num_bytes = send_weights(trainer, rollout.adapter)
    elif rollout.adapter is not trainer.adapter:
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
