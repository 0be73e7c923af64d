"""Stage `sync_weights`: make the rollout engine sample from the updated policy.

Colocated (one process or one actor): the rollout samples with the trainer's own adapter, so only the
policy version moves. Split (a rollout actor with its own adapter copy): the trainer exports the
tensors changed since the last export, tagged with the new version, and the rollout actor loads them;
the buckets travel actor to actor through Ray's object store.
"""

from __future__ import annotations

import time

from prefect import task

from engines import cluster
from engines.train.sync import export_weights, load_weights
from tasks.common import STAGE, inject_fault, stage_cache_key


def sync_impl(engines: cluster.Engines, step: int, chunk: int = 0) -> dict:
    inject_fault("sync_weights", step)
    return {k: float(v) for k, v in engines.trainer.sync_weights(engines.rollout).items()}


def export_impl(engines: cluster.Engines, step: int, chunk: int = 0) -> dict:
    """Split placement, trainer side: the changed tensors as versioned buckets (bumps the policy version)."""
    inject_fault("sync_weights", step)
    trainer = engines.trainer
    started = time.perf_counter()
    buckets = list(export_weights(trainer, version=trainer.policy_version + 1))
    trainer._version += 1  # the same bookkeeping as engines.train.sync.sync_weights
    trainer._stepped_since_sync = False
    return {"buckets": buckets, "lora_cfg": trainer.cfg if trainer.cfg.lora else None,
            "targets": trainer.cfg.lora_targets, "version": trainer.policy_version,
            "export_s": time.perf_counter() - started}


def load_impl(engines: cluster.Engines, export: dict) -> dict:
    """Split placement, rollout side: apply the buckets to this actor's adapter and take their version."""
    started = time.perf_counter()
    for bucket in export["buckets"]:
        load_weights(engines.adapter, bucket, lora_cfg=export["lora_cfg"], targets=export["targets"])
    engines.extras["policy_version"] = export["version"]
    tensors = [t for b in export["buckets"] for t in b.tensors.values()]
    return {"timing_s/sync_weights": export["export_s"] + time.perf_counter() - started,
            "sync/num_tensors": float(len(tensors)), "sync/bytes": float(sum(t.numel() * t.element_size()
                                                                             for t in tensors)),
            "sync/policy_version": float(export["version"])}


def sync_engines(engines, step: int) -> dict:
    """Bring the rollout to the trainer's weights wherever they live (local, colocated or split actors)."""
    if engines.split:
        return engines.pipe(("trainer", export_impl), ("rollout", load_impl), step)
    return engines.run("trainer", sync_impl, step)


@task(name="sync_weights", cache_key_fn=stage_cache_key("sync_weights"), **STAGE)
def sync_weights(run_name: str, step: int) -> dict:
    return sync_engines(cluster.get(run_name), step)
