"""Stages of the direct-preference step (flows/dp_step.py): offline pairs, old-policy rollout, the update.

Each stage is a plain `<stage>_impl(engines, step[, chunk])` function plus a thin Prefect task that
finds the run's engines and calls it; the task's cache key is (run, step, stage, chunk), like every
stage in tasks/.
"""

from __future__ import annotations

import json
import os
import time

import torch
from prefect import task

from algorithms.catalog import Algorithm
from engines import cluster
from engines.train.preference import preference_pairs
from engines.trajectories import Trajectories
from models.base import SampleShape
from tasks.common import STAGE, inject_fault, sample_seed, stage_cache_key
from tasks.generate import generate_impl
from tasks.update import _commit_checkpoint, checkpoint_dir, latest_checkpoint

PREFERENCE_REWARD = "preference"   # the reward component of offline pairs: 1 chosen, 0 rejected


def uses_old_policy_rollout(algorithm: Algorithm) -> bool:
    """DiffusionNFT samples its rollouts with the old (EMA) policy, as the published code does."""
    return algorithm.loss == "diffusion_nft_loss"


def training_rows(algorithm: Algorithm, rewards: torch.Tensor, advantages: torch.Tensor, group_ids: list[str],
                  valid: torch.Tensor) -> tuple[list[int], dict[str, float]]:
    """Which of a step's samples the algorithm trains on, and statistics of that choice.

    DPO: per group the best and the worst valid sample, as a (chosen, rejected) pair (rows come out
    chosen, rejected, chosen, ...; groups whose samples all tie are skipped). DiffusionNFT and AWM:
    every valid sample, weighted by its advantage in the loss.
    """
    kept = valid.nonzero().squeeze(1).tolist()
    if algorithm.loss != "dpo_loss":
        return kept, {"dp/num_samples": float(len(kept))}
    pairs = [(kept[w], kept[l]) for w, l in preference_pairs(advantages[kept], [group_ids[i] for i in kept])]
    rows = [i for pair in pairs for i in pair]
    stats = {"dp/num_pairs": float(len(pairs)), "dp/num_samples": float(len(rows))}
    if pairs:
        stats["dp/chosen_reward"] = float(rewards[[w for w, _ in pairs]].mean())
        stats["dp/rejected_reward"] = float(rewards[[l for _, l in pairs]].mean())
    return rows, stats


# ------------------------------------------------------------------------------ offline pairs
def offline_pairs_impl(engines: cluster.Engines, step: int) -> dict:
    """Commit the step's preference pairs (from the VAE-latent cache) as chunk 0 of the trajectory table,
    with reward 1 for the chosen and 0 for the rejected image; a committed step is reused."""
    store = engines.store
    reused = store.has_chunk(step, 0)
    t0 = time.perf_counter()
    if not reused:
        inject_fault("offline_pairs", step)
        store.append(_pair_trajectories(engines, step), run=engines.config.run.name, step=step, chunk=0)
    traj = store.read_chunk(step, 0, with_latents=False, with_images=False)
    # Rewards are written after the rows; writing them again is a no-op, so a crash in between heals here.
    rewards = (traj.sample_index == 0).float()
    store.write_rewards(step, traj, rewards, {PREFERENCE_REWARD: rewards}, torch.ones(len(traj), dtype=torch.bool))
    return {"step": step, "rows": len(traj), "seconds": time.perf_counter() - t0, "reused": reused}


def _pair_trajectories(engines: cluster.Engines, step: int) -> Trajectories:
    """(2P) samples of the step's P pairs, chosen then rejected, as a one-step window ending at x0.

    Only the clean latent latents[:, -1] is trained on by the direct-preference trainer; an offline
    sample has no denoising trajectory, so latents[:, 0] repeats x0 and the log-probs are 0.
    """
    cfg = engines.config
    sampling = cfg.sampling
    n = sampling.num_inference_steps
    records = engines.prompts.sample(step)
    latents_P2S, images_P2HWC = engines.extras["preferences"].read([r.metadata["pair"] for r in records])
    x0 = latents_P2S.flatten(0, 1)
    b = x0.shape[0]
    shape = SampleShape(sampling.height, sampling.width, sampling.num_frames)
    last_sigma = float(engines.adapter.sigmas(n, shape)[n - 1])
    prompts = [r.prompt for r in records for _ in range(2)]
    encoder = engines.rollout if engines.rollout is not None else engines.trainer._replayer  # split trainer actor
    return Trajectories(
        prompts=prompts, group_ids=[r.uid for r in records for _ in range(2)],
        sample_index=torch.tensor([0, 1] * len(records)),
        seeds=torch.tensor([sample_seed(cfg.run.seed, step, k) for k in range(b)]),
        latents=torch.stack([x0, x0], 1).float().contiguous(), log_probs=torch.zeros(b, 1),
        sigmas=torch.full((b, 1), last_sigma), sigmas_prev=torch.zeros(b, 1),
        window_starts=torch.full((b,), n - 1), trained=torch.ones(b, 1, dtype=torch.bool),
        images=images_P2HWC.flatten(0, 1), embed_keys=[encoder.embed_key(p, sampling) for p in prompts],
        metadata=[{"pair": r.metadata["pair"], "label": label} for r in records for label in ("chosen", "rejected")],
        policy_version=engines.trainer.policy_version)


@task(name="offline_pairs", cache_key_fn=stage_cache_key("offline_pairs"), **STAGE)
def offline_pairs(run_name: str, step: int) -> dict:
    """Reads the latent cache and commits rows: runs where the trainer lives."""
    return cluster.get(run_name).run("trainer", offline_pairs_impl, step)


# ------------------------------------------------------------------------------ old-policy rollout
def generate_with_old_policy_impl(engines: cluster.Engines, step: int, chunk: int) -> dict:
    """The `generate` stage with DiffusionNFT's old adapter active (the trainer's own module)."""
    if engines.trainer is None or engines.rollout.adapter is not engines.trainer.adapter:
        raise ValueError("diffusion_nft samples with the trainer's old LoRA adapter, so the rollout must run on "
                         "the trainer's model (cluster.placement: colocated)")
    with engines.trainer.old_policy():
        return generate_impl(engines, step, chunk)


@task(name="generate", cache_key_fn=stage_cache_key("generate"), **STAGE)
def generate_with_old_policy(run_name: str, step: int, chunk: int) -> dict:
    """Runs where the run's rollout lives (this process, or its Ray actor)."""
    return cluster.get(run_name).run("rollout", generate_with_old_policy_impl, step, chunk)


# ------------------------------------------------------------------------------ the update
def update_preference_impl(engines: cluster.Engines, step: int) -> dict:
    """Train on the rows the algorithm selects; commit a checkpoint exactly as tasks/update.py does, so
    a step whose checkpoint exists is never trained again (its saved metrics come back)."""
    run_dir = engines.config.run_dir
    done = checkpoint_dir(run_dir, step)
    if latest_checkpoint(run_dir) == step and os.path.isdir(done):
        with open(os.path.join(done, "update_metrics.json")) as f:
            return json.load(f)
    inject_fault("update_actor", step)
    t0 = time.perf_counter()
    store = engines.store
    traj = store.read_step(step, with_images=False)
    advantages = store.read_advantages(step)
    rewards, _, valid = store.read_rewards(step)
    rows, stats = training_rows(engines.config.algorithm, rewards, advantages, traj.group_ids, valid)
    metrics = engines.trainer.update(traj.select(rows), advantages[rows], engines.rollout)
    metrics = {**{k: float(v) for k, v in metrics.items()}, **stats}
    metrics["timing_s/update_actor"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    _commit_checkpoint(engines, step, metrics)
    metrics["timing_s/checkpoint"] = time.perf_counter() - t1
    return metrics


@task(name="update_actor", cache_key_fn=stage_cache_key("update_actor"), **STAGE)
def update_preference(run_name: str, step: int) -> dict:
    """Never retried automatically: an optimizer step is not idempotent (the checkpoint is)."""
    return cluster.get(run_name).run("trainer", update_preference_impl, step)
