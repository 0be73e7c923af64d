"""Stage `update_actor`: the policy update on a step's trajectories, committed as a checkpoint.

The checkpoint is written inside this stage, so a completed (Cached) update always has its
checkpoint; and a step whose checkpoint exists is never trained again: its saved metrics come back.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from prefect import task

from engines import cluster
from engines.train.setup import barrier, world
from tasks.common import STAGE, inject_fault, stage_cache_key


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step}")


def latest_checkpoint(run_dir: str) -> int | None:
    """The last step whose checkpoint was committed (None before the first)."""
    pointer = os.path.join(run_dir, "checkpoints", "latest.json")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return int(json.load(f)["step"])


def _commit_checkpoint(engines: cluster.Engines, step: int, metrics: dict) -> str:
    """Every trainer rank saves (the state is gathered); rank 0 alone prepares, commits and prunes."""
    cfg = engines.config
    final = checkpoint_dir(cfg.run_dir, step)
    tmp = final + ".tmp"
    rank = world()[0]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()  # no rank writes into tmp before rank 0 has cleared it
    engines.trainer.save_checkpoint(tmp, step=step)
    if rank != 0:
        return final
    with open(os.path.join(tmp, "update_metrics.json"), "w") as f:
        json.dump(metrics, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # the checkpoint appears whole or not at all
    pointer = os.path.join(cfg.run_dir, "checkpoints", "latest.json")
    with open(pointer + ".tmp", "w") as f:
        json.dump({"step": step, "path": final}, f)
    os.replace(pointer + ".tmp", pointer)
    previous = checkpoint_dir(cfg.run_dir, step - 1)
    if step - 1 >= 0 and (step - 1) % max(cfg.run.checkpoint_every, 1) and os.path.isdir(previous):
        shutil.rmtree(previous)  # only every checkpoint_every-th step is kept, plus the latest
    return final


def update_impl(engines: cluster.Engines, step: int, chunk: int = 0) -> dict:
    """The policy update of `step` and its checkpoint; a step already checkpointed returns its saved metrics."""
    done = checkpoint_dir(engines.config.run_dir, step)
    if latest_checkpoint(engines.config.run_dir) == step and os.path.isdir(done):
        with open(os.path.join(done, "update_metrics.json")) as f:
            return json.load(f)
    inject_fault("update_actor", step)
    t0 = time.perf_counter()
    traj = engines.store.read_step(step, with_images=False)
    advantages = engines.store.read_advantages(step)
    _, _, valid = engines.store.read_rewards(step)
    keep = valid.nonzero().squeeze(1)
    metrics = engines.trainer.update(traj.select(keep), advantages[keep], engines.rollout)
    metrics = {k: float(v) for k, v in metrics.items()}
    metrics["timing_s/update_actor"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    _commit_checkpoint(engines, step, metrics)
    metrics["timing_s/checkpoint"] = time.perf_counter() - t1
    return metrics


def load_checkpoint_impl(engines: cluster.Engines, path: str) -> int:
    """Resume: the trainer takes the weights and optimizer state of checkpoint `path`."""
    return engines.trainer.load_checkpoint(path)


@task(name="update_actor", cache_key_fn=stage_cache_key("update_actor"), **STAGE)
def update_actor(run_name: str, step: int) -> dict:
    """Never retried automatically: an optimizer step is not idempotent (the checkpoint is)."""
    return cluster.get(run_name).run("trainer", update_impl, step)
