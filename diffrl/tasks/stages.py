"""The stages of one RL step as Prefect tasks: each finds the run's engines by name and calls the step core's
stage (diffrl/engines/step/run.py STAGES), which runs where the stage's role lives (this process, or a Ray actor), and
persists its typed result as JSON keyed by (run, step, stage, chunk).

Retries: none automatic. An optimizer step is not idempotent (its checkpoint is); a retried flow run finds the
completed stages Cached and reruns the rest.
"""

from __future__ import annotations

import os
import re
from typing import Any

from prefect import task

from diffrl.engines import cluster
from diffrl.engines.step.generate import step_chunks
from diffrl.engines.step.records import as_record, from_record
from diffrl.engines.step.run import STAGES
from diffrl.engines.step.update import latest_checkpoint
from diffrl.tasks.common import (
    STAGE,
    call_stage,
    check_results,
    run_key_prefix,
    stage_cache_key,
    stage_key,
    submit_stage,
)


def _run(stage: str, run_name: str, step: int, chunk: int = 0) -> dict:
    return as_record(STAGES[stage][0](cluster.get(run_name), step, chunk))


@task(
    name="generate",
    task_run_name="generate-step{step}-chunk{chunk}",
    cache_key_fn=stage_cache_key("generate"),
    **STAGE,
)
def generate_chunk(run_name: str, step: int, chunk: int) -> dict:
    """One chunk's rollout (or the rollout that ran ahead of it), where the run's rollout lives."""
    return _run("generate", run_name, step, chunk)


@task(
    name="score",
    task_run_name="score-step{step}-chunk{chunk}",
    cache_key_fn=stage_cache_key("score"),
    **STAGE,
)
def score_chunk(run_name: str, step: int, chunk: int) -> dict:
    """One chunk's rewards, on the reward pool, while the next chunk generates."""
    return _run("score", run_name, step, chunk)


@task(
    name="offline_pairs",
    task_run_name="offline_pairs-step{step}",
    cache_key_fn=stage_cache_key("offline_pairs"),
    **STAGE,
)
def offline_pairs(run_name: str, step: int) -> dict:
    """Offline DPO: the step's pairs from the VAE-latent cache, where the trainer lives."""
    return _run("offline_pairs", run_name, step)


@task(name="advantages", task_run_name="advantages-step{step}", cache_key_fn=stage_cache_key("advantages"), **STAGE)
def compute_advantages(run_name: str, step: int) -> dict:
    """Group advantages, beside the reward pool."""
    return _run("advantages", run_name, step)


@task(
    name="update_actor", task_run_name="update_actor-step{step}", cache_key_fn=stage_cache_key("update_actor"), **STAGE
)
def update_actor(run_name: str, step: int) -> dict:
    """The policy update and its checkpoint, where the trainer lives."""
    return _run("update_actor", run_name, step)


@task(
    name="sync_weights", task_run_name="sync_weights-step{step}", cache_key_fn=stage_cache_key("sync_weights"), **STAGE
)
def sync_weights(run_name: str, step: int) -> dict:
    """The rollout takes the updated weights (and starts the next step's rollout)."""
    return _run("sync_weights", run_name, step)


TASKS = {
    "generate": generate_chunk,
    "score": score_chunk,
    "offline_pairs": offline_pairs,
    "advantages": compute_advantages,
    "update_actor": update_actor,
    "sync_weights": sync_weights,
}


class PrefectStages:
    """run_step's stages as this module's Prefect tasks (diffrl/engines/step/run.py Stages)."""

    def __init__(self, run_name: str, cfg: Any):
        self.run_name, self.cfg = run_name, cfg

    def _args(self, name: str, step: int, chunk: int) -> tuple:
        return (self.run_name, step, chunk) if name in ("generate", "score") else (self.run_name, step)

    def call(self, name: str, step: int, chunk: int = 0) -> Any:
        return from_record(STAGES[name][1], call_stage(self.cfg, TASKS[name], *self._args(name, step, chunk)))

    def submit(self, name: str, step: int, chunk: int = 0) -> Any:
        return _Typed(submit_stage(self.cfg, TASKS[name], *self._args(name, step, chunk)), STAGES[name][1])


class _Typed:
    """A Prefect future whose result comes back as the stage's record type."""

    def __init__(self, future: Any, kind: type):
        self.future, self.kind = future, kind

    def result(self) -> Any:
        return from_record(self.kind, self.future.result())


def check_step_results(engines: Any, step: int, results_dir: str) -> None:
    """Before `step` runs: every persisted result of its stages that a cache lookup would read is plain JSON data
    (else UntrustedResult naming the file: Prefect's lookup would skip it without a word)."""
    cfg, uid = engines.config, engines.run_uid
    stages = [(stage, chunk) for chunk in range(step_chunks(cfg)) for stage in ("generate", "score")]
    stages += [(stage, 0) for stage in ("offline_pairs", "advantages", "update_actor", "sync_weights")]
    check_results(results_dir, [stage_key(cfg.run.name, uid, step, stage, chunk) for stage, chunk in stages])


def last_persisted_step(engines: Any, results_dir: str) -> int | None:
    """The last step with a persisted stage result in `results_dir` (this run incarnation's keys). The step after the
    checkpoint being written may have run its first stages meanwhile: a crash then leaves their results without
    their rows, which forget_unfinished must see too."""
    prefix = run_key_prefix(engines.config.run.name, engines.run_uid)
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    names = os.listdir(results_dir) if os.path.isdir(results_dir) else []
    return max((int(m.group(1)) for m in map(pattern.match, names) if m), default=None)


def forget_unfinished(engines: Any, step: int, results_dir: str) -> list[str]:
    """Before `step` runs again (resume): drop the persisted results of its stages whose durable output is not on
    disk, so those stages run again instead of coming back Cached. The step core writes rows, rewards, advantages
    and the checkpoint behind the stages that made them, in that order; a crash can leave a stage Completed in
    Prefect whose writes never landed. Returns the stage keys dropped."""
    cfg, store = engines.config, engines.store
    uid = engines.run_uid
    chunks = step_chunks(cfg)
    committed = store.committed_chunks(step)
    rows_ok = committed == set(range(chunks))
    rewards_ok = rows_ok and _rewards_stored(store, step)
    advantages_ok = rewards_ok and _readable(store.read_advantages, step)
    checkpoint_ok = latest_checkpoint(cfg.run_dir) == step
    stale = [("offline_pairs", 0)] if not rows_ok else []
    for chunk in range(chunks):
        if chunk not in committed:
            stale.append(("generate", chunk))
        if not rewards_ok:
            stale.append(("score", chunk))
    if not advantages_ok:
        stale.append(("advantages", 0))
    if not checkpoint_ok:
        stale += [("update_actor", 0), ("sync_weights", 0)]
    dropped = []
    for stage, chunk in stale:
        path = os.path.join(results_dir, stage_key(cfg.run.name, uid, step, stage, chunk))
        if os.path.exists(path):
            os.remove(path)
            dropped.append(os.path.basename(path))
    return dropped


def _rewards_stored(store: Any, step: int) -> bool:
    """Every sample of `step` has its stored reward (an excluded one is stored as such: scored, not lost) and some
    are valid (a step stored with none valid, before a chunk with nothing scored failed its stage, scores again)."""
    try:
        return bool(store.read_rewards(step)[2].any())
    except ValueError:
        return False


def _readable(read, step: int) -> bool:
    try:
        read(step)
        return True
    except ValueError:
        return False
