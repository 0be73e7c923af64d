"""Stage `generate`: one chunk of the step's rollout into the trajectory table."""

from __future__ import annotations

import time

from prefect import task

from engines import cluster
from tasks.common import STAGE, inject_fault, sample_seed, stage_cache_key


def chunk_plan(engines: cluster.Engines, step: int, chunk: int) -> dict:
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


def num_chunks(engines: cluster.Engines) -> int:
    cfg = engines.config
    return -(-cfg.rollout.samples_per_step // cfg.rollout.chunk_size)


def generate_impl(engines: cluster.Engines, step: int, chunk: int) -> dict:
    """Roll out one chunk and commit it; a chunk already committed is not generated again."""
    if engines.store.has_chunk(step, chunk):
        return {"step": step, "chunk": chunk, "rows": None, "seconds": 0.0, "reused": True}
    inject_fault("generate", step, chunk)
    plan = chunk_plan(engines, step, chunk)
    records = plan["records"]
    t0 = time.perf_counter()
    traj = engines.rollout.generate(
        [r.prompt for r in records], [r.uid for r in records], plan["sample_index"], plan["seeds"],
        engines.config.sampling, step=step, policy_version=engines.policy_version,
        metadata=[{"ground_truth": r.ground_truth, **r.metadata} for r in records])
    seconds = time.perf_counter() - t0
    engines.store.append(traj, run=engines.config.run.name, step=step, chunk=chunk)
    return {"step": step, "chunk": chunk, "rows": len(traj), "seconds": seconds, "reused": False}


@task(name="generate", cache_key_fn=stage_cache_key("generate"), **STAGE)
def generate_chunk(run_name: str, step: int, chunk: int) -> dict:
    """Runs where the run's rollout lives (this process, or its Ray actor)."""
    return cluster.get(run_name).run("rollout", generate_impl, step, chunk)
