"""What a step samples, decided before anything runs: prompts, seeds and chunks of a step, the validation batch,
and the fault-injection hook of the stage tests. Pure functions of the config and the run's prompt sampler."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any

from diffrl.configs.rollout import OdeShortcut, RolloutWeights
from diffrl.engines.handle import Engines
from diffrl.engines.numbering import step_number
from diffrl.engines.train.setup import world

STALL_S = 5.0  # how long a `stall` fault point hangs before it kills the process


def sample_seed(run_seed: int, step: int, global_index: int) -> int:
    """A per-sample generator seed that depends only on (run seed, step, sample position)."""
    digest = hashlib.sha256(f"{run_seed}:{step}:{global_index}".encode()).digest()
    return int.from_bytes(digest[:7], "little")  # < 2**56: fits torch.Generator.manual_seed


def num_chunks(cfg: Any) -> int:
    """Generate chunks per step: samples_per_step / chunk_size, rounded up."""
    return -(-cfg.rollout.samples_per_step // cfg.rollout.chunk_size)


def replica_chunks(cfg: Any, replica: int) -> range:
    """The chunks engine replica `replica` generates: the replica-th contiguous N-th of the step's chunks (so its
    prompt groups stay together where they fit in its share); every chunk with one replica."""
    per_replica = num_chunks(cfg) // cfg.cluster.replicas
    return range(replica * per_replica, (replica + 1) * per_replica)


def own_chunks(cfg: Any) -> list[int]:
    """The chunks of a step this process generates: its engine replica's share (every chunk with one process; the one
    chunk of offline pairs)."""
    if cfg.data.sample_source == "offline":
        return [0]
    return list(replica_chunks(cfg, world()[0]))


def chunk_owner(cfg: Any, chunk: int) -> int:
    """The engine replica that generates (and scores) chunk `chunk`."""
    return chunk // (num_chunks(cfg) // cfg.cluster.replicas)


def chunk_plan(engines: Engines, step: int, chunk: int) -> dict:
    """Which samples chunk `chunk` of `step` holds: prompt-major order, group_size samples per prompt."""
    cfg = engines.config
    records = engines.prompts.sample(step)
    group = cfg.rollout.group_size
    start = chunk * cfg.rollout.chunk_size
    stop = min(start + cfg.rollout.chunk_size, len(records) * group)
    positions = list(range(start, stop))
    return {
        "records": [records[p // group] for p in positions],
        "sample_index": [p % group for p in positions],
        "seeds": [sample_seed(cfg.run.seed, step, p) for p in positions],
    }


def validation_batch(records: list, run_seed: int, copies: int = 1) -> dict:
    """`RolloutEngine.generate` arguments for `copies` images of each validation prompt record: copy c of
    record i has sample index c and seed run_seed + 7 + i + c * len(records) (copy 0 keeps the seeds a
    one-image validation always used), and carries the record's ground truth for the reward."""
    n = len(records)
    rows = [(c, i) for c in range(copies) for i in range(n)]
    return dict(
        prompts=[records[i].prompt for _, i in rows],
        group_ids=[records[i].uid for _, i in rows],
        sample_index=[c for c, _ in rows],
        seeds=[run_seed + 7 + i + c * n for c, i in rows],
        metadata=[{"ground_truth": records[i].ground_truth, **records[i].metadata} for _, i in rows],
    )


def validation_rollout(rollout, cfg, records: list, *, step: int = 0, **sampling):
    """ODE samples (noise level 0) of the validation `records`, `cfg.data.val_samples_per_prompt` each
    (validation_batch's seeds), with the config's sampling; `sampling` overrides its fields (guidance_scale,
    num_inference_steps). An SDE window longer than the steps is cut to them: at noise 0 it only marks steps.
    A token rollout (an algorithm on tokens) decodes greedily instead (temperature 0), with the weights it holds (a
    vLLM server refuses any other policy version)."""
    batch = validation_batch(records, cfg.run.seed, cfg.data.val_samples_per_prompt)
    if cfg.algorithm.needs.data == "tokens":
        greedy = dataclasses.replace(cfg.sampling, temperature=0.0, **sampling)
        return rollout.generate(cfg=greedy, step=step, policy_version=rollout.policy_version, **batch)
    # the ODE shortcuts (rollout.ode_tail / ode_head), rollout.sort_by_window and rollout.weights are rollout levers,
    # not the policy: validation samples every step with the trained weights, in the caller's batches
    off = OdeShortcut()
    ode = dataclasses.replace(
        cfg.sampling,
        noise_level=0.0,
        ode_tail=off,
        ode_head=off,
        sort_by_window=False,
        weights=RolloutWeights(),
        **sampling,
    )
    if ode.window.size > ode.num_inference_steps:
        ode = dataclasses.replace(
            ode, window=dataclasses.replace(ode.window, size=ode.num_inference_steps, start_range=(0, None))
        )
    return rollout.generate(cfg=ode, step=step, **batch)


def validation_due(cfg: Any, steps_done: int) -> bool:
    """Whether the run validates after `steps_done` RL steps: every run.validate_every steps and after the last."""
    every = cfg.run.validate_every
    return bool(every and steps_done % every == 0) or steps_done == cfg.run.steps


def inject_fault(stage: str, step: int, chunk: int = 0) -> bool:
    """Fault injection for resume/retry tests and drills: DIFFRL_INJECT_FAULT="stage@k[.chunk][:action]", k a step
    number as the console shows it (`update_actor@1`: the first step's update; `step` here is the code's index). For the
    stages every engine replica runs (advantages, update_actor, sync_weights) the number after the dot is the replica
    (`update_actor@2.1`: replica 1's update of step 2).

    `raise` (default) fails the stage with RuntimeError, as an out-of-memory would; `oom` with torch's own
    OutOfMemoryError (what a GPU out of memory raises: a CPU machine cannot run out that way); `exit` kills the
    process on the spot (os._exit(137), like SIGKILL) to test crash recovery; `stall` kills it the same way after
    STALL_S seconds stuck there (a hung disk), while the rest of the process goes on; `nan` returns True, and the
    fault point makes its value NaN (`loss@<step>:nan`: the update's loss). Unset, or another point: False.
    """
    spec = os.environ.get("DIFFRL_INJECT_FAULT", "")
    if not spec:
        return False
    where, _, action = spec.partition(":")
    target_stage, _, position = where.partition("@")
    target_step, _, target_chunk = position.partition(".")
    if target_stage != stage or int(target_step or -1) != step_number(step) or int(target_chunk or 0) != chunk:
        return False
    if action == "nan":
        return True
    if action == "stall":
        time.sleep(STALL_S)
    if action in ("exit", "stall"):
        os._exit(137)
    if action == "oom":
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected in stage {stage!r} at step {step_number(step)})")
    raise RuntimeError(
        f"injected fault in stage {stage!r} at step {step_number(step)} chunk {chunk} (DIFFRL_INJECT_FAULT)"
    )
