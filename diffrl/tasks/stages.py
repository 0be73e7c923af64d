"""The stages of one RL step as Prefect tasks: each finds the run's engines by name and calls the step core's
stage (diffrl/engines/step/run.py STAGES), which runs where the stage's role lives (this process, or a Ray actor), and
persists its typed result as JSON keyed by (run, step, stage, chunk).

With engine replicas (`cluster.gpus: N`) a stage that runs on them is one task per replica, named after it:
generate-step3-replica1-chunk2 (replica 1 generates chunk 2), advantages-step3-replica1, update_actor-step3-replica1,
sync_weights-step3-replica1, keyed by (run, step, stage, chunk) for generate and (run, step, stage, replica) for the
stages every replica runs at once.

Retries: none automatic. An optimizer step is not idempotent (its checkpoint is); a retried flow run finds the
completed stages Cached and reruns the rest.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from prefect import task

from diffrl.engines import cluster, trace
from diffrl.engines.handle import EngineHandle
from diffrl.engines.numbering import step_number
from diffrl.engines.step.generate import step_chunks
from diffrl.engines.step.records import as_record, from_record
from diffrl.engines.step.run import STAGES
from diffrl.engines.step.update import latest_checkpoint
from diffrl.tasks.common import (
    STAGE,
    check_results,
    run_key_prefix,
    stage_cache_key,
    stage_key,
)


def _run(stage: str, run_name: str, step: int, chunk: int = 0, replica: int | None = None) -> dict:
    return as_record(STAGES[stage][0](cluster.get(run_name), step, chunk, replica))


def task_name(stage: str) -> Callable[..., str]:
    """A stage task's run name: <stage>-step<k>[-replica<r>][-chunk<c>] (generate-step3-chunk1, update_actor-step3,
    generate-step3-replica1-chunk2)."""

    def name(parameters: dict) -> str:
        parts = [stage, f"step{step_number(parameters['step'])}"]  # the step number (diffrl/engines/numbering.py)
        if parameters.get("replica") is not None:
            parts.append(f"replica{parameters['replica']}")
        if "chunk" in parameters:
            parts.append(f"chunk{parameters['chunk']}")
        return "-".join(parts)

    return name


def replica_cache_key(stage: str) -> Callable[[Any, dict], str]:
    """Cache key of a stage that runs once per replica: (run, step, stage, replica) (replica 0 alone: the stage's
    single key)."""
    key = stage_cache_key(stage)
    return lambda context, params: key(context, {**params, "chunk": params.get("replica") or 0})


@task(name="generate", task_run_name=task_name("generate"), cache_key_fn=stage_cache_key("generate"), **STAGE)
def generate_chunk(run_name: str, step: int, chunk: int, replica: int | None = None) -> dict:
    """One chunk's rollout (or the rollout that ran ahead of it), where the run's rollout lives (on `replica`)."""
    return _run("generate", run_name, step, chunk, replica)


@task(name="score", task_run_name=task_name("score"), cache_key_fn=stage_cache_key("score"), **STAGE)
def score_chunk(run_name: str, step: int, chunk: int) -> dict:
    """One chunk's rewards, on the reward pool, while the next chunk generates."""
    return _run("score", run_name, step, chunk)


@task(
    name="offline_pairs",
    task_run_name=task_name("offline_pairs"),
    cache_key_fn=stage_cache_key("offline_pairs"),
    **STAGE,
)
def offline_pairs(run_name: str, step: int) -> dict:
    """Offline DPO: the step's pairs from the VAE-latent cache, where the trainer lives."""
    return _run("offline_pairs", run_name, step)


@task(
    name="dataset_samples",
    task_run_name=task_name("dataset_samples"),
    cache_key_fn=stage_cache_key("dataset_samples"),
    **STAGE,
)
def dataset_samples(run_name: str, step: int) -> dict:
    """SFT: the step's (prompt, image) rows of the dataset, VAE-encoded where the trainer lives."""
    return _run("dataset_samples", run_name, step)


@task(
    name="advantages",
    task_run_name=task_name("advantages"),
    cache_key_fn=replica_cache_key("advantages"),
    **STAGE,
)
def compute_advantages(run_name: str, step: int, replica: int | None = None) -> dict:
    """Group advantages over the whole step, beside the reward pool (`replica`'s part: its rows)."""
    return _run("advantages", run_name, step, 0, replica)


@task(
    name="update_actor",
    task_run_name=task_name("update_actor"),
    cache_key_fn=replica_cache_key("update_actor"),
    **STAGE,
)
def update_actor(run_name: str, step: int, replica: int | None = None) -> dict:
    """The policy update and its checkpoint, where the trainer lives (`replica`'s rank of the replicas' group)."""
    return _run("update_actor", run_name, step, 0, replica)


@task(
    name="sync_weights",
    task_run_name=task_name("sync_weights"),
    cache_key_fn=replica_cache_key("sync_weights"),
    **STAGE,
)
def sync_weights(run_name: str, step: int, replica: int | None = None) -> dict:
    """The rollout takes the updated weights (and starts the next step's rollout) (on `replica`)."""
    return _run("sync_weights", run_name, step, 0, replica)


REPLICATED = ("advantages", "update_actor", "sync_weights")  # one task per engine replica, keyed by replica
TASKS = {
    "generate": generate_chunk,
    "score": score_chunk,
    "offline_pairs": offline_pairs,
    "dataset_samples": dataset_samples,
    "advantages": compute_advantages,
    "update_actor": update_actor,
    "sync_weights": sync_weights,
}


# run name -> (step, stage) of the stage the flow started last: where an interrupted run was (its one line)
_STARTED: dict[str, tuple[int, str]] = {}


def mark_started(run_name: str, step: int | None, stage: str | None = None) -> None:
    """The flow of run `run_name` starts step `step` (its `stage`; None: the run starts, no step yet)."""
    _STARTED[run_name] = (step, stage)


def last_started(run_name: str) -> tuple[int | None, str | None]:
    """(step, stage) the flow of run `run_name` started last in this process; (None, None) before any step."""
    return _STARTED.get(run_name, (None, None))


class PrefectStages:
    """run_step's stages as this module's Prefect tasks (diffrl/engines/step/run.py Stages)."""

    def __init__(self, run_name: str, cfg: Any):
        self.run_name, self.cfg = run_name, cfg

    def _args(self, name: str, step: int, chunk: int, replica: int | None) -> tuple:
        if name == "generate":
            return (self.run_name, step, chunk, replica)
        if name == "score":
            return (self.run_name, step, chunk)
        return (self.run_name, step, replica) if name in REPLICATED else (self.run_name, step)

    def call(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any:
        args = self._args(name, step, chunk, replica)
        mark_started(self.run_name, step, name)
        with trace.span(f"task {name}", step=step, chunk=chunk):  # the stage's own span inside; the rest is Prefect
            return from_record(STAGES[name][1], TASKS[name](*args))

    def submit(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any:
        args = self._args(name, step, chunk, replica)
        mark_started(self.run_name, step, name)
        return _Typed(TASKS[name].submit(*args), STAGES[name][1])


class _Typed:
    """A Prefect future whose result comes back as the stage's record type."""

    def __init__(self, future: Any, kind: type):
        self.future, self.kind = future, kind

    def result(self) -> Any:
        return from_record(self.kind, self.future.result())

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self.future.add_done_callback(lambda _: fn(self))


def check_step_results(engines: EngineHandle, step: int, results_dir: str) -> None:
    """Before `step` runs: every persisted result of its stages that a cache lookup would read is plain JSON data
    (else UntrustedResult naming the file: Prefect's lookup would skip it without a word)."""
    cfg, uid = engines.config, engines.run_uid
    stages = [(stage, chunk) for chunk in range(step_chunks(cfg)) for stage in ("generate", "score")]
    stages += [("offline_pairs", 0), ("dataset_samples", 0)]
    stages += [(stage, replica) for stage in REPLICATED for replica in range(cfg.cluster.replicas)]
    check_results(results_dir, [stage_key(cfg.run.name, uid, step, stage, chunk) for stage, chunk in stages])
    forget_partly_replicated(engines, step, results_dir)


def forget_partly_replicated(engines: EngineHandle, step: int, results_dir: str) -> list[str]:
    """Drop the persisted results of a stage every replica runs at once (advantages, update, weight sync) that only
    some replicas finished (a replica died before its result was written): Cached on some replicas and run on the
    others, the replicas would part ways (a weight sync bumping one policy version only, then an update with other
    passes on each: a collective that never completes). The stage then runs again on all of them. Returns the keys
    dropped."""
    cfg = engines.config
    if cfg.cluster.replicas == 1:
        return []
    dropped = []
    for stage in REPLICATED:
        keys = [stage_key(cfg.run.name, engines.run_uid, step, stage, r) for r in range(cfg.cluster.replicas)]
        present = sum(os.path.exists(os.path.join(results_dir, key)) for key in keys)
        if 0 < present < len(keys):
            dropped += _drop_results(results_dir, keys)
    return dropped


KEEP_RESULT_STEPS = 2  # the step just done and the one before: a retry from the UI reruns the step in flight


def forget_old_results(engines: EngineHandle, step: int, results_dir: str) -> int:
    """After `step` is done: remove the persisted stage results of the run's steps before the last KEEP_RESULT_STEPS
    (of every incarnation of the run: an older one's keys are never looked up again). A resume or a retry from the
    UI starts after the last checkpoint, so no cache lookup reads them; without this the folder grows by a file per
    stage and chunk every step. Returns how many were removed."""
    cutoff = step - KEEP_RESULT_STEPS + 1
    pattern = re.compile(re.escape(f"diffrl-{engines.config.run.name}-") + r"[0-9a-f]+-step(\d+)-")
    removed = 0
    for name in os.listdir(results_dir) if os.path.isdir(results_dir) else []:
        found = pattern.match(name)
        if found and int(found.group(1)) < cutoff:
            try:
                os.remove(os.path.join(results_dir, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def last_persisted_step(engines: EngineHandle, results_dir: str) -> int | None:
    """The last step with a persisted stage result in `results_dir` (this run incarnation's keys). The step after the
    checkpoint being written may have run its first stages meanwhile: a crash then leaves their results without
    their rows, which forget_unfinished must see too."""
    prefix = run_key_prefix(engines.config.run.name, engines.run_uid)
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    names = os.listdir(results_dir) if os.path.isdir(results_dir) else []
    return max((int(m.group(1)) for m in map(pattern.match, names) if m), default=None)


def forget_unfinished(engines: EngineHandle, step: int, results_dir: str) -> list[str]:
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
    stale = [("offline_pairs", 0), ("dataset_samples", 0)] if not rows_ok else []
    for chunk in range(chunks):
        if chunk not in committed:
            stale.append(("generate", chunk))
        if not rewards_ok:
            stale.append(("score", chunk))
    if not advantages_ok:
        stale += [("advantages", replica) for replica in range(cfg.cluster.replicas)]
    if not checkpoint_ok:
        trained = ("update_actor", "sync_weights")
        stale += [(stage, replica) for stage in trained for replica in range(cfg.cluster.replicas)]
    return _drop_results(results_dir, [stage_key(cfg.run.name, uid, step, stage, chunk) for stage, chunk in stale])


def _drop_results(results_dir: str, keys: list[str]) -> list[str]:
    """Delete the persisted stage results `keys` that exist (those stages then run again); returns the ones deleted."""
    dropped = []
    for key in keys:
        path = os.path.join(results_dir, key)
        if os.path.exists(path):
            os.remove(path)
            dropped.append(key)
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
