"""Stage `advantages`: group-normalised advantages of a step from its committed rewards."""

from __future__ import annotations

import torch
from prefect import task

from algorithms.advantages import advantage_stats, group_advantages, reward_stats
from engines import cluster
from tasks.common import STAGE, inject_fault, stage_cache_key


def advantages_impl(engines: cluster.Engines, step: int, chunk: int = 0) -> dict:
    """Excluded samples (a failed optional reward) get no advantage and are not trained on."""
    inject_fault("advantages", step)
    algo = engines.config.algorithm
    rewards, components, valid = engines.store.read_rewards(step)
    keys = engines.store.read_step(step, with_latents=False, with_images=False)
    group_ids = keys.group_ids
    advantages = torch.zeros_like(rewards)
    kept = valid.nonzero().squeeze(1)
    kept_groups = [group_ids[i] for i in kept.tolist()]
    advantages[kept] = group_advantages(rewards[kept], kept_groups, norm_by_std=algo.norm_by_std,
                                        global_std=algo.global_std)
    engines.store.write_advantages(step, keys, advantages)
    stats = {**reward_stats(rewards[kept], kept_groups), **advantage_stats(advantages[kept])}
    for name, scores in components.items():  # reward/<name>: each component over the kept samples
        stats[f"reward/{name}"] = scores[kept].float().mean()
    return {k: float(v) for k, v in stats.items()}


@task(name="advantages", cache_key_fn=stage_cache_key("advantages"), **STAGE)
def compute_advantages(run_name: str, step: int) -> dict:
    """Table work only: runs beside the reward pool (this process, or the run's reward actor)."""
    return cluster.get(run_name).run("reward", advantages_impl, step)
