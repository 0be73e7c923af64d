"""Stages that learn from a step's samples: `advantages`, `update` (both trainer families, plus the checkpoint that
commits the step) and the weight sync (`sync`).

A step is done when its checkpoint is committed: `checkpoints/latest.json` names it. The checkpoint is queued on
the background writer after the step's rows, rewards and advantages, so it can only commit after them; a step
whose checkpoint exists is never trained again (its saved metrics come back).
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch

from diffrl.algorithms.advantages import advantage_stats, group_advantages, reward_stats
from diffrl.algorithms.losses_token import nonconstant_groups
from diffrl.algorithms.staleness import fresh_groups, sample_staleness, staleness_stats
from diffrl.engines import trace
from diffrl.engines.handle import Engines
from diffrl.engines.numbering import step_index, step_number
from diffrl.engines.reward.multi import drop_partial_components
from diffrl.engines.step.generate import (
    prefetch,
    step_reward_info,
    step_rewards,
    step_trajectories,
    store_call,
    store_submit,
)
from diffrl.engines.step.plan import inject_fault
from diffrl.engines.step.records import Advantaged, Synced, Updated
from diffrl.engines.step.replicas import step_rewards_of_every_replica, training_samples
from diffrl.engines.step.tokens import shape_rewards, token_metrics
from diffrl.engines.store import fs
from diffrl.engines.store.integrity import DamagedStore, write_record
from diffrl.engines.train import checkpoint
from diffrl.engines.train.preference import preference_pairs
from diffrl.engines.train.setup import barrier, world
from diffrl.engines.train.throughput import add_update_rates

# How many steps the background writer may lag behind the update before the update waits for it.
WRITER_LAG_STEPS = 2


# ---- advantages ---------------------------------------------------------------------------------------
def advantages(engines: Engines, step: int, chunk: int = 0) -> Advantaged:
    """Group-normalised advantages of the step's valid samples (an excluded sample gets NaN, stored as such: it is
    not trained on); critic/* and reward/<component> metrics over the kept samples. Engine replicas exchange their
    rewards and each normalises over the whole step (the same numbers on every replica); each stores its own rows'."""
    inject_fault("advantages", step, world()[0])  # `advantages@k.r`: replica r's
    algo = engines.config.algorithm
    exchanged = step_rewards_of_every_replica(engines, step)
    if exchanged is None:
        keys = step_trajectories(engines, step, with_latents=False)
        rewards, components, valid = step_rewards(engines, step)
        group_ids, own_rows = list(keys.group_ids), None
    else:
        keys, own_rows, (rewards, components, valid, group_ids) = exchanged
        engines.memory.put_step_rewards(step, (rewards, components, valid))  # for the update
    weights = {c.name: c.weight for c in engines.config.reward.components}
    rewards, left_out = drop_partial_components(rewards, components, valid, weights)  # an optional one was down
    kept = valid.nonzero().squeeze(1)
    extra = {}
    if algo.needs.data == "tokens":  # verl's language-RL metrics; DAPO's length shaping of the rewards
        extra = token_metrics(engines, keys, rewards, kept)
        rewards = shape_rewards(engines, rewards, keys)
    advantages_B = torch.full_like(rewards, float("nan"))  # excluded samples: marked, never a silent 0
    kept_groups = [group_ids[i] for i in kept.tolist()]
    advantages_B[kept] = group_advantages(
        rewards[kept],
        kept_groups,
        norm_by_std=algo.norm_by_std,
        global_std=algo.global_std,
        eps=algo.adv_eps,
        ddof=algo.adv_std_ddof,
    )
    engines.memory.put_advantages(step, advantages_B)
    mine = advantages_B if own_rows is None else advantages_B[own_rows]
    store_submit(engines, step, f"advantages of step {step_number(step)}", _write_advantages, engines, step, keys, mine)
    stats = {**reward_stats(rewards[kept], kept_groups), **advantage_stats(advantages_B[kept])}
    for name, scores in components.items():  # reward/<name>: each component over the kept samples it scored
        stats[f"reward/{name}"] = scores[kept].float().nanmean()
    stats.update({f"reward/left_out/{name}": 1.0 for name in left_out})
    stats.update(step_reward_info(engines, step, kept))
    stats.update(extra)
    # where the reward has its own process, nothing else releases it; the step before stays (the flow may still be
    # logging its rollout images while the run-ahead worker is here: diffrl/engines/step/ahead.py)
    engines.memory.release_before(step - 1)
    return Advantaged(step, {k: float(v) for k, v in stats.items()})


def _write_advantages(engines: Engines, step: int, keys: Any, advantages_B: torch.Tensor) -> None:
    engines.store.write_advantages(step, keys, advantages_B)


def step_advantages(engines: Engines, step: int) -> torch.Tensor:
    held = engines.memory.advantages(step)
    if held is not None:
        return held
    return store_call(
        engines, step, f"read advantages of step {step_number(step)}", engines.store.read_advantages, step
    )


# ---- update -------------------------------------------------------------------------------------------
def training_rows(
    algorithm: Any, rewards: torch.Tensor, advantages_B: torch.Tensor, group_ids: list[str], valid: torch.Tensor
) -> tuple[list[int], dict[str, float]]:
    """Which of a step's samples the algorithm trains on, and statistics of that choice.

    As the algorithm's needs say: every valid sample (weighted by its advantage in the loss), or for a pair algorithm
    (DPO) per group the best and the worst valid sample, as a (chosen, rejected) pair (rows come out chosen, rejected,
    chosen, ...; groups whose samples all tie are skipped); with needs.varied_groups (DAPO) only the groups whose
    rewards differ. dp/* statistics for final-sample algorithms.
    """
    kept = valid.nonzero().squeeze(1).tolist()
    needs = algorithm.needs
    stats = {}
    if needs.varied_groups:  # DAPO's dynamic sampling: groups whose rewards all tie teach nothing
        varied = nonconstant_groups(rewards[kept], [group_ids[i] for i in kept]).tolist()
        stats["actor/varied_group_samples"] = float(sum(varied))
        kept = [i for i, keep in zip(kept, varied) if keep]
    if not needs.pairs:
        return kept, {**stats, "dp/num_samples": float(len(kept))} if needs.data == "final_samples" else stats
    pairs = [
        (kept[win], kept[lose]) for win, lose in preference_pairs(advantages_B[kept], [group_ids[i] for i in kept])
    ]
    rows = [i for pair in pairs for i in pair]
    stats = {"dp/num_pairs": float(len(pairs)), "dp/num_samples": float(len(rows))}
    if pairs:
        stats["dp/chosen_reward"] = float(rewards[[w for w, _ in pairs]].mean())
        stats["dp/rejected_reward"] = float(rewards[[lose for _, lose in pairs]].mean())
    return rows, stats


def fresh_rows(traj: Any, rows: list[int], trainer_version: int, max_staleness: int) -> tuple[list[int], dict]:
    """The `rows` whose prompt group is at most `max_staleness` policy versions behind `trainer_version`, and
    async/staleness_{mean,max} (of those) and async/dropped (the others). Every row of a step carries its oldest
    chunk's version (a step's chunks are sampled at one version; a reused, stored one may be older)."""
    staleness_B = sample_staleness(torch.full((len(traj),), traj.policy_version), trainer_version)
    picked = torch.tensor(rows, dtype=torch.long)
    fresh = fresh_groups(staleness_B[picked], [traj.group_ids[i] for i in rows], max_staleness)
    return picked[fresh].tolist(), staleness_stats(staleness_B[picked], fresh)


def _rows_to_train(engines: Engines, step: int, traj: Any) -> tuple[list[int], torch.Tensor, dict, dict[str, float]]:
    """(rows, advantages (B,), reward components, statistics) of the step's samples the update trains on. A dataset's
    samples (SFT, needs.supervised) have no reward: every row, advantages 0 (its loss does not read them)."""
    algorithm = engines.config.algorithm
    if algorithm.needs.supervised:
        return list(range(len(traj))), torch.zeros(len(traj)), {}, {"sft/num_samples": float(len(traj))}
    advantages_B = step_advantages(engines, step)
    rewards, components, valid = step_rewards(engines, step)
    rows, stats = training_rows(algorithm, rewards, advantages_B, traj.group_ids, valid)
    return rows, advantages_B, components, stats


def update(engines: Engines, step: int, chunk: int = 0) -> Updated:
    """Train on the step (the rows `training_rows` picks) and commit its checkpoint; a step whose checkpoint is
    committed returns its saved metrics instead (an optimizer step is not idempotent, the checkpoint is)."""
    run_dir = engines.config.run_dir
    done = checkpoint_dir(run_dir, step)
    durable = engines.store is not None  # engines-only runs keep no checkpoints either
    if durable and latest_checkpoint(run_dir) == step and fs.isdir(done):
        saved = fs.read_json(fs.join(done, "update_metrics.json"))
        return Updated(step, rows=int(saved.pop("update/rows", 0)), metrics=saved)
    inject_fault("update_actor", step, world()[0])
    started = time.perf_counter()
    engines.memory.release_writes()  # the step's rows, rewards and advantages land while the GPU trains
    traj, exchange = training_samples(engines, step)  # engine replicas: every one's chunks, all-gathered
    rows, advantages_B, components, stats = _rows_to_train(engines, step, traj)
    asynchronous = engines.config.run.async_
    if asynchronous.enabled:
        # the next step's rollout samples with the behaviour copy (the weights of the last sync) while this update
        # trains; samples of an older policy train when their groups are within max_staleness
        prefetch(engines, step + 1)
        rows, staleness = fresh_rows(traj, rows, engines.trainer.policy_version, asynchronous.max_staleness)
        stats.update(staleness)
    if inject_fault("loss", step):  # DIFFRL_INJECT_FAULT=loss@<step>:nan -> NaN advantages: a NaN loss and gradient
        advantages_B = advantages_B * float("nan")
    gate = {}
    if engines.config.algorithm.needs.reward_gate:  # GARDO: the KL gate from the trained samples' reward components
        gate["kl_gate"] = engines.config.algorithm.reward_gate({name: c[rows] for name, c in components.items()})
    metrics = engines.trainer.update(traj.select(rows), advantages_B[rows], engines.rollout, **gate)
    checkpoint.check_finite_weights(engines.trainer, step)  # never trained on, or checkpointed, past this point
    metrics = {**{k: float(v) for k, v in metrics.items()}, **stats, **exchange}
    metrics["timing_s/update_actor"] = time.perf_counter() - started
    # the token trainer's rates over the whole stage's time, as timing_s/update_actor reports it
    add_update_rates(metrics, metrics["timing_s/update_actor"], getattr(engines.trainer, "device", "cpu"))
    metrics.update(memory_metrics())
    if durable:
        committed = time.perf_counter()
        commit_checkpoint(engines, step, {**metrics, "update/rows": float(len(rows))}, samples=len(traj))
        metrics["timing_s/checkpoint"] = time.perf_counter() - committed
    engines.memory.release_before(step - 1)
    waited = time.perf_counter()
    with trace.span("writer_wait", step=step):
        engines.memory.writer.wait(step - WRITER_LAG_STEPS)  # memory stays bounded if the disk falls behind
    # how long the step waited for the background writer (rows, rewards, checkpoints two steps back): where the
    # disk, not the GPU, sets the pace
    metrics["timing_s/writer_wait"] = time.perf_counter() - waited
    return Updated(step, rows=len(rows), metrics=metrics)


def memory_metrics() -> dict[str, float]:
    """verl's perf/max_memory_{allocated,reserved}_gb (GiB, the peak of this process's CUDA device so far: the
    trainer's process; a vLLM server's memory is its own); nothing on a run without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {
        "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
    }


# ---- checkpoints --------------------------------------------------------------------------------------
def checkpoint_dir(run_dir: str, step: int) -> str:
    """The checkpoint folder of step index `step`: `checkpoints/step_<k>`, k its step number (the weights after k
    RL steps; diffrl/engines/numbering.py)."""
    return fs.join(run_dir, "checkpoints", f"step_{step_number(step)}")


def latest_checkpoint(run_dir: str) -> int | None:
    """The step index of the last step whose checkpoint was committed (None before the first); latest.json holds
    its step number."""
    pointer = fs.join(run_dir, "checkpoints", "latest.json")
    if not fs.exists(pointer):
        return None
    try:
        return step_index(int(fs.read_json(pointer)["step"]))
    except (ValueError, KeyError, TypeError) as e:  # not JSON, not UTF-8, no step: not what point_latest wrote
        raise DamagedStore(
            f"{pointer} is not the checkpoint pointer diffrl writes ({type(e).__name__}: {e}): write "
            '{"step": k} naming a kept checkpoints/step_<k> folder into it, or train under a new run.name'
        ) from None


def resume_candidates(run_dir: str, newest: int) -> list[int]:
    """The step indices of the checkpoints to try, best first: `newest` (latest.json's), then the kept step_<k>
    folders before it, newest first (a damaged checkpoint falls back to the one before it)."""
    named = [re.fullmatch(r"step_(\d+)", name) for name in fs.listdir(fs.join(run_dir, "checkpoints"))]
    kept = sorted((step_index(int(m.group(1))) for m in named if m), reverse=True)  # folders: step numbers
    return [newest] + [k for k in kept if k < newest]


def staging_dir(run_dir: str, step: int) -> str:
    """Where step `step`'s checkpoint is written before it commits: step_<k>.tmp, renamed to step_<k> on a local
    disk; step_<k> itself on an object store, where a rename is a copy (there latest.json, written last, is the
    commit, and a folder it does not name is never loaded)."""
    final = checkpoint_dir(run_dir, step)
    return final if fs.is_uri(run_dir) else final + ".tmp"


def commit_checkpoint(engines: Engines, step: int, metrics: dict, samples: int = 0) -> None:
    """Save the trainer and commit the step, recording its `samples` samples (stored_rows.json). A single-process LoRA
    trainer is snapshotted now and written by the background writer (after the step's rows); otherwise every rank
    saves here (the state is gathered) once its writes of the step landed, and rank 0 commits."""
    cfg, trainer, memory = engines.config, engines.trainer, engines.memory
    if memory.asynchronous and trainer.cfg.lora and trainer.world_size == 1:
        # The state now, copied to the host without waiting for the GPU; the files on the writer, after the step's
        # rows, once the copies landed. trainer_state.json records the step number.
        state = checkpoint.snapshot(trainer, step=step_number(step))
        memory.writer.submit(
            step,
            f"checkpoint of step {step_number(step)}",
            _write_and_commit,
            cfg.run_dir,
            step,
            cfg.run.checkpoint_every,
            metrics,
            lambda path: checkpoint.write(state, path),
            samples,
        )
        return
    rank = world()[0]
    tmp = staging_dir(cfg.run_dir, step)
    if rank == 0:
        fs.remove_tree(tmp)
    memory.writer.wait(step)  # the checkpoint commits after this replica's rows, rewards and advantages of the step
    barrier()  # no rank writes into tmp before rank 0 has cleared it (nor before every replica's writes landed)
    trainer.save_checkpoint(tmp, step=step_number(step))
    if rank == 0:
        _write_and_commit(cfg.run_dir, step, cfg.run.checkpoint_every, metrics, None, samples)


def _write_and_commit(run_dir: str, step: int, every: int, metrics: dict, write, samples: int) -> str:
    """Write (when `write` is given) into the staging folder (`staging_dir`) with the record of the stored rows up to
    the step (diffrl/engines/store/integrity.py), make it step_<k> (locally a rename), then point latest.json at it:
    the step is committed when latest.json names it, and the folder it names is whole. Only every `every`-th
    checkpoint is kept, plus the latest two (a damaged latest one falls back to the one before:
    diffrl/flows/train.load_good_checkpoint)."""
    final, staged = checkpoint_dir(run_dir, step), staging_dir(run_dir, step)
    if write is not None:
        fs.remove_tree(staged)
        write(staged)
    fs.write_json(fs.join(staged, "update_metrics.json"), metrics)
    previous = checkpoint_dir(run_dir, step - 1)
    write_record(staged, previous if step > 0 and latest_checkpoint(run_dir) == step - 1 else None, step, samples)
    if staged != final:
        fs.sync_tree(staged)  # on the disk before the rename and the pointer name it
        fs.remove_tree(final)
        fs.move(staged, final)
        fs.sync_dir(fs.parent(final))
    point_latest(run_dir, step)
    previous = checkpoint_dir(run_dir, step - 2)  # kept when its step number is a multiple of `every`
    if step - 2 >= 0 and step_number(step - 2) % max(every, 1) and fs.isdir(previous):
        fs.remove_tree(previous)
    return final


def point_latest(run_dir: str, step: int) -> None:
    """Make checkpoints/latest.json name step `step`'s checkpoint (in one piece: fs.write_json): the step is
    committed."""
    pointer = fs.join(run_dir, "checkpoints", "latest.json")
    fs.write_json(pointer, {"step": step_number(step), "path": checkpoint_dir(run_dir, step)})


def load_checkpoint(engines: Engines, path: str) -> int:
    """Resume: the trainer takes the weights and optimizer state of checkpoint `path`. Weights that do not fit the
    model (another model, LoRA rank or targets than the run was trained with) are a ValueError naming the checkpoint
    and the first tensor that differs (torch lists every one, hundreds of lines)."""
    try:
        return engines.trainer.load_checkpoint(path)
    except RuntimeError as e:
        header, _, rest = str(e).partition("\n")
        if not header.startswith("Error(s) in loading state_dict"):
            raise
        raise ValueError(
            f"checkpoint {path} does not fit the model this config builds ({rest.strip().splitlines()[0][:300]}): the "
            "run was trained with another model or LoRA shape; undo that change, or train under a new run.name"
        ) from e


# ---- weight sync --------------------------------------------------------------------------------------
def sync(engines: Engines, step: int, chunk: int = 0, prefetch_next: bool = True) -> Synced:
    """Make the rollout sample with the updated weights (colocated: only the policy version moves; asynchronous: the
    trained LoRA tensors are copied into the behaviour copy once the rollouts sampling with it ended), then start the
    next step's rollout on the rollout worker (diffrl/engines/step/generate.prefetch). A rollout engine that
    measures itself (`take_metrics`: the vLLM engine's KV cache, concurrency, tokens/s, wake and sleep) adds what it
    measured during this step."""
    inject_fault("sync_weights", step, world()[0])
    if engines.config.run.async_.enabled and engines.memory is not None:
        waited = time.perf_counter()
        engines.memory.wait_rollouts()  # the rollouts sampling with the behaviour copy end before it is overwritten
        waited = time.perf_counter() - waited
    else:
        waited = 0.0
    metrics = {k: float(v) for k, v in engines.trainer.sync_weights(engines.rollout).items()}
    take_metrics = getattr(engines.rollout, "take_metrics", None)
    if take_metrics is not None:
        metrics.update({k: float(v) for k, v in take_metrics().items()})
    if engines.config.run.async_.enabled:
        metrics["timing_s/sync_rollout_wait"] = waited
    started = prefetch(engines, step + 1) if prefetch_next else 0
    return Synced(step, prefetched=started, metrics=metrics)
