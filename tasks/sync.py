"""Stage `sync_weights`: make the rollout engine sample from the updated policy."""

from __future__ import annotations

from prefect import task

from engines import cluster
from tasks.common import STAGE, inject_fault, stage_cache_key


@task(name="sync_weights", cache_key_fn=stage_cache_key("sync_weights"), **STAGE)
def sync_weights(run_name: str, step: int) -> dict:
    engines = cluster.get(run_name)
    inject_fault("sync_weights", step)
    return {k: float(v) for k, v in engines.trainer.sync_weights(engines.rollout).items()}
