"""Stage `score`: rewards of one committed chunk, written beside the trajectories."""

from __future__ import annotations

import time

import torch
from prefect import task

from engines import cluster
from tasks.common import STAGE, inject_fault, stage_cache_key


def score_impl(engines: cluster.Engines, step: int, chunk: int) -> dict:
    """Score a chunk's images with the run's reward and write the rewards beside the trajectories."""
    inject_fault("score", step, chunk)
    traj = engines.store.read_chunk(step, chunk, with_latents=False)
    t0 = time.perf_counter()
    out = engines.reward(traj.images, traj.prompts, traj.metadata)
    seconds = time.perf_counter() - t0
    components = {name: torch.tensor(out.info[name], dtype=torch.float32) for name in engines.reward.names}
    engines.store.write_rewards(step, traj, out.scores, components, out.valid)
    return {"step": step, "chunk": chunk, "seconds": seconds, "rows": len(traj),
            "excluded": int((~out.valid).sum())}


@task(name="score", cache_key_fn=stage_cache_key("score"), **STAGE)
def score_chunk(run_name: str, step: int, chunk: int) -> dict:
    """Runs on the reward pool (this process, or the run's reward actor) while the next chunk generates."""
    return cluster.get(run_name).run("reward", score_impl, step, chunk)
