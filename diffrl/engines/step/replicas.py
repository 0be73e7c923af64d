"""What engine replicas (`cluster.gpus: N`) hand each other in a step: the step's samples for the update.

Each replica generated its own chunks (diffrl/engines/step/plan.replica_chunks) and holds them in its memory; every
replica trains its share of every mini-batch of the whole step, so before the update each needs all N shares. They
are all-gathered over the replicas' process group (NVLink or the network with NCCL, gloo on CPUs) instead of every
replica reading the whole step's latents back from the Lance store: an all-gather moves (N-1)/N of the step's latents
into each replica once, where the store read cost each replica all of them through Arrow decoding. A replica that no
longer holds its chunks (a resumed step, a restarted actor) makes every replica read the store instead, so all ranks
take the same path.

Legend: B samples a replica generated (equal on every replica), N replicas.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from diffrl.engines.handle import Engines
from diffrl.engines.step.generate import step_trajectories, store_call
from diffrl.engines.step.memory import cat_rewards
from diffrl.engines.step.plan import own_chunks
from diffrl.engines.train.setup import world
from diffrl.engines.trajectories import Trajectories

# Per-sample tensors every replica gathers (images stay behind: the update never reads them).
_TENSORS = ("sample_index", "seeds", "latents", "log_probs", "sigmas", "sigmas_prev", "window_starts", "trained")
_LISTS = ("prompts", "group_ids", "embed_keys", "metadata")


def training_samples(engines: Engines, step: int) -> tuple[Trajectories, dict[str, float]]:
    """The step's samples for the update: gathered from the replicas (with `timing_s/exchange` and `exchange/bytes`,
    what this replica received), else from memory or the store."""
    started = time.perf_counter()
    traj = gathered_step(engines, step)
    if traj is None:
        return step_trajectories(engines, step), {}
    received = sum(getattr(traj, name).numel() * getattr(traj, name).element_size() for name in _TENSORS)
    size = world()[1]
    return traj, {"timing_s/exchange": time.perf_counter() - started, "exchange/bytes": received * (size - 1) / size}


def gathered_step(engines: Engines, step: int) -> Trajectories | None:
    """The whole step's samples in (chunk, row) order, gathered from every replica's memory; None with one process or
    when any replica lacks its chunks in memory (then the caller reads the store, on every replica)."""
    rank, size = world()
    if size == 1:
        return None
    held = [engines.memory.chunk(step, chunk) for chunk in own_chunks(engines.config)]
    device = _device()
    everyone = torch.tensor([float(all(h is not None for h in held))], device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)  # one path for all ranks: the gathers below are collectives
    if everyone.item() < 1:
        _every_replicas_writes_landed(engines, step)  # the caller reads the whole step from the store
        return None
    return _all_gather(Trajectories.cat([traj for traj, _ in held]), size, device)


def _all_gather(local: Trajectories, size: int, device: str) -> Trajectories:
    """Every replica's B samples, concatenated in rank order (= chunk order: replica r holds the r-th share)."""
    tensors = {}
    for name in _TENSORS:
        mine = getattr(local, name)
        sendable = mine.to(device=device, dtype=torch.uint8 if mine.dtype == torch.bool else mine.dtype)
        parts = [torch.empty_like(sendable) for _ in range(size)]
        dist.all_gather(parts, sendable.contiguous())
        tensors[name] = torch.cat(parts).to(device="cpu", dtype=mine.dtype)
    lists: list[Any] = [None] * size
    dist.all_gather_object(lists, {name: getattr(local, name) for name in _LISTS})
    # the oldest policy version of the step's chunks (an asynchronous run trains them by their staleness)
    version = torch.tensor([local.policy_version], dtype=torch.int64, device=device)
    dist.all_reduce(version, op=dist.ReduceOp.MIN)
    total = len(local) * size
    return Trajectories(
        **{name: [item for part in lists for item in part[name]] for name in _LISTS},
        **tensors,
        images=torch.zeros((total, 0, 0, 3), dtype=torch.uint8),  # as the store returns a step read without images
        policy_version=int(version.item()),
    )


def _device() -> str:
    """Where the process group's tensors live: the GPU for NCCL, the CPU for gloo."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def step_rewards_of_every_replica(engines: Engines, step: int) -> tuple[list[tuple[str, int]], list[int], tuple] | None:
    """Engine replicas: (this replica's samples' keys (group id, sample index), their rows in the whole step, the whole
    step's
    (rewards, components, valid, group_ids)) with the rewards exchanged over the process group; None with one
    process. A replica that no longer holds its chunks' rewards (a resumed step whose scores came back Cached) makes
    every replica read the whole step from the store instead, once every replica's writes of the step landed."""
    rank, size = world()
    if size == 1:
        return None
    cfg, memory = engines.config, engines.memory
    chunks = own_chunks(cfg)
    rewards = memory.rewards_of(step, chunks)
    everyone = torch.tensor([float(rewards is not None)], device=_device())
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)  # one path for all ranks: the gather below is a collective
    first = chunks[0] * cfg.rollout.chunk_size
    if everyone.item() < 1:
        _every_replicas_writes_landed(engines, step)
        whole = store_call(engines, step, f"read step {step}", engines.store.read_step, step, with_latents=False)
        stored = store_call(engines, step, f"read rewards of step {step}", engines.store.read_rewards, step)
        rows = list(range(first, first + len(chunks) * cfg.rollout.chunk_size))
        return _keys([whole.select(rows)]), rows, (*stored, list(whole.group_ids))
    mine = _keys([_own_chunk(engines, step, chunk) for chunk in chunks])
    parts: list[Any] = [None] * size
    scores, components, valid = rewards
    dist.all_gather_object(parts, (scores, components, valid, [group for group, _ in mine]))
    whole = (*cat_rewards([p[:3] for p in parts]), [g for p in parts for g in p[3]])
    return mine, list(range(first, first + len(mine))), whole


def _every_replicas_writes_landed(engines: Engines, step: int) -> None:
    """Wait until this replica's queued writes of `step` landed, then for every other replica's (a collective)."""
    store_call(engines, step, f"writes of step {step}", lambda: None)
    dist.barrier()


def _keys(parts: list[Trajectories]) -> list[tuple[str, int]]:
    """(group id, sample index) of every sample of `parts`, in order: what the store keys a row's reward by."""
    return [(g, int(i)) for t in parts for g, i in zip(t.group_ids, t.sample_index.tolist())]


def _own_chunk(engines: Engines, step: int, chunk: int) -> Trajectories:
    """One of this replica's chunks: held in memory, or committed (a chunk an earlier process generated)."""
    held = engines.memory.chunk(step, chunk)
    if held is not None:
        return held[0]
    read = engines.store.read_chunk
    return store_call(engines, step, f"read chunk {chunk}", read, step, chunk, with_latents=False, with_images=False)
