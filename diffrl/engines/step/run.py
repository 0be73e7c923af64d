"""One RL step, the only place its stages are sequenced: the Prefect flow (diffrl/flows/rl_step.py) runs it with its
stages as Prefect tasks, the benchmarks and tests run it with the stages called directly (`DirectStages`).

    online:  for each chunk: generate(chunk) ; score(chunk) runs while the next chunk generates
    offline: offline_pairs(step)   -- offline DPO's pairs from the VAE-latent cache
    SFT:     dataset_samples(step) -- a dataset's (prompt, image) rows; no reward, so no advantages stage
    advantages(step) -> update_actor(step) (+ checkpoint) -> sync_weights(step) (+ the next step's rollout)

With N engine replicas (`cluster.gpus: N`, Ray actors), each replica runs the local pipeline on its share: replica r
generates the r-th N-th of the step's chunks (a round of chunks, one per replica, at once) and scores them while it
samples; the advantages are normalised over the whole step (the replicas exchange their rewards), exactly as with one
replica; advantages, update_actor and sync_weights are one call on every replica at once (their trainers are one FSDP2
group). A stage call names the replica it runs on, so each replica's part of a stage is its own Prefect task, retried
like any other.

Every stage runs once per (stage, step, chunk) where the engines live (`_here`): the flow's task, or the run-ahead
worker of that process (diffrl/engines/step/ahead.py), which runs the next step's stages of its own share as soon as
the weight sync started the next rollout.

Which trainer, which rows and which rollout policy a step uses follow from the algorithm (diffrl/engines/step/update.py
`training_rows`, diffrl/engines/step/generate.py `uses_old_policy_rollout`), so policy-gradient and direct-preference
algorithms share this sequence.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from diffrl.engines import trace
from diffrl.engines.cluster import ReplicaLost
from diffrl.engines.handle import EngineHandle, Engines
from diffrl.engines.reward.image_stats import stat_metrics
from diffrl.engines.step import generate as sample_stages
from diffrl.engines.step import update as learn_stages
from diffrl.engines.step.plan import chunk_owner, replica_chunks
from diffrl.engines.step.records import Advantaged, Generated, Scored, StepResult, Synced, Updated
from diffrl.engines.train.setup import world

log = logging.getLogger("diffrl")


def sync_engines(engines: EngineHandle, step: int, *, prefetch_next: bool = True) -> Synced:
    """Bring the rollout to the trainer's weights on every replica at once, outside a step (a resume): the shared
    adapter only moves its version, a full fine-tuning replica loads its rollout copy."""
    return engines.run("trainer", learn_stages.sync, step, 0, prefetch_next)


def _here(name: str, fn: Callable, engines: Engines, step: int, chunk: int = 0) -> Any:
    """`fn(engines, step, chunk)` run once per (stage, step, chunk) in the process that holds `engines`: a second
    caller of the same stage run (the flow's task, or the run-ahead worker) gets the first one's record."""

    def run():
        with trace.span(name, step=step, chunk=chunk):
            return fn(engines, step, chunk)

    ahead = _run_ahead(engines)
    return run() if ahead is None else ahead.once((name, step, chunk), run)


def _run_ahead(engines: Engines) -> Any:
    return engines.memory.ahead if engines.memory is not None else None


def _on(role: str, name: str, fn: Callable) -> Callable:
    """The driver-side call of a stage: `fn(engines, step, chunk)` where its role lives (on every replica at once for
    "trainer"); `replica` picks one replica instead (its share, or its part of a collective stage). A partial of
    module functions: Ray ships it to the actors by name."""
    here = functools.partial(_here, name, fn)

    def call(engines: EngineHandle, step: int, chunk: int = 0, replica: int | None = None):
        if name == "score":  # on the replica that sampled the chunk: its rewards were streamed there
            replica = chunk_owner(engines.config, chunk)
        if replica is None:
            return engines.run(role, here, step, chunk)
        return engines.run_one(role, replica, here, step, chunk)

    call.__name__ = fn.__name__
    return call


# Stage name -> (driver-side call running the stage where its role lives, the record type it returns).
STAGES: dict[str, tuple[Callable, type]] = {
    name: (_on(role, name, fn), kind)
    for name, (role, fn, kind) in {
        "generate": ("rollout", sample_stages.generate, Generated),
        "score": ("reward", sample_stages.score, Scored),
        "offline_pairs": ("trainer", sample_stages.offline_pairs, Generated),
        "dataset_samples": ("trainer", sample_stages.dataset_samples, Generated),
        "advantages": ("trainer", learn_stages.advantages, Advantaged),
        "update_actor": ("trainer", learn_stages.update, Updated),
        "sync_weights": ("trainer", learn_stages.sync, Synced),
    }.items()
}


class Stages(Protocol):
    """How run_step calls a stage: wait for it (`call`) or start it and wait later (`submit(...).result()`; the future
    also takes `add_done_callback(fn)`). `replica` names the engine replica a call runs on (None: where the stage's
    role lives)."""

    def call(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any: ...

    def submit(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any: ...


class DirectStages:
    """The stages called on the engines directly, without Prefect (benchmarks, tests, the engines-only loop)."""

    def __init__(self, engines: EngineHandle, workers: int | None = None):
        self.engines = engines
        # a generate and a score in flight per replica; a collective stage needs a call on every replica at once
        workers = workers or 2 * engines.config.cluster.replicas
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="diffrl-stage")

    def call(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any:
        return STAGES[name][0](self.engines, step, chunk, replica)

    def submit(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any:
        return self._pool.submit(self.call, name, step, chunk, replica)


def run_step(engines: EngineHandle, step: int, stages: Stages) -> StepResult:
    """Run RL step `step` on `engines` through `stages`; returns its metrics (verl's names). Then, where the
    engines live (this process, or each replica), the next step's stages start on the run-ahead worker
    (diffrl/engines/step/ahead.py)."""
    try:
        result = _run_stages(engines, step, stages)
    except BaseException:
        settle(engines)
        raise
    engines.run("trainer", run_ahead, step)
    return result


def run_ahead(engines: Engines, step: int) -> bool:
    """After the flow recorded step `step`: where the engines live, start step `step + 1`'s stages of this process's
    share on the run-ahead worker, once its rollout runs. Only a rollout started in this process counts: a resumed
    step's weight sync can come back Cached from Prefect, its record saying that the earlier process prefetched, while
    here nothing synced yet (a vLLM server just started holds version 0). Not with hacking-guard bounds: a step
    that trips one is the run's last. Returns whether it started."""
    ahead = _run_ahead(engines)
    if ahead is None:
        return False
    ahead.done_before(step)
    if engines.config.run.guard.bounds:  # the flow checks each step against the bounds before the next one trains
        return False
    share = world()[0]  # this replica (0 with one process)
    if not engines.memory.has_chunk(step + 1, replica_chunks(engines.config, share)[0]):
        return False
    if ahead.stages is None:
        ahead.stages = DirectStages(engines, workers=2)  # a generate and a score in flight
    ahead.start(step + 1, functools.partial(_run_stages, engines, step + 1, ahead.stages, share))
    return True


def _run_stages(engines: EngineHandle, step: int, stages: Stages, share: int | None = None) -> StepResult:
    """The stages of step `step` in order through `stages`; its record. `share` None: the flow's calls on every
    replica; `share` r: replica r's own calls, made in its process (the run-ahead)."""
    cfg = engines.config
    started = time.perf_counter()
    generated: list[Generated] = []
    scored: list[Scored] = []
    reward_wait = 0.0
    supervised = cfg.algorithm.needs.supervised
    if supervised:
        generated.append(stages.call("dataset_samples", step))
    elif cfg.data.sample_source == "offline":
        generated.append(stages.call("offline_pairs", step))
    else:
        pending = []
        for round_ in _generate_rounds(stages, cfg, step, share):
            for done in round_:
                generated.append(done)
                pending.append(stages.submit("score", step, done.chunk))  # overlaps with the next round
        rollout_done = time.perf_counter()
        scored = [future.result() for future in pending]
        reward_wait = time.perf_counter() - rollout_done
    advantaged = None if supervised else _on_every_replica(stages, cfg, "advantages", step, share)
    updated = _on_every_replica(stages, cfg, "update_actor", step, share)
    synced = _on_every_replica(stages, cfg, "sync_weights", step, share)
    seconds = time.perf_counter() - started
    metrics = step_metrics(
        cfg, generated, scored, advantaged, updated, synced, seconds=seconds, reward_wait=reward_wait
    )
    return StepResult(step, metrics)


def _generate_rounds(stages: Stages, cfg: Any, step: int, share: int | None = None):
    """The step's generate calls, a round at a time: one chunk (one replica, or replica `share`'s own), or one chunk
    on each of N replicas at once (replica r generating chunks r*K ... r*K + K-1 of the step's N*K:
    diffrl/engines/step/plan.replica_chunks)."""
    replicas = cfg.cluster.replicas
    if replicas == 1 or share is not None:
        for chunk in replica_chunks(cfg, share or 0):
            yield [stages.call("generate", step, chunk)]
        return
    shares = [replica_chunks(cfg, r) for r in range(replicas)]
    for k in range(len(shares[0])):
        futures = [stages.submit("generate", step, share[k], replica=r) for r, share in enumerate(shares)]
        yield gather(futures, fail_fast=False)  # no collective among them: the chunks that finish are kept


def _on_every_replica(stages: Stages, cfg: Any, name: str, step: int, share: int | None = None) -> Any:
    """A stage of the replicas' trainer group: one call per replica, all at once (they meet in collectives); rank 0's
    record (metrics are reduced over the ranks already). Replica `share`'s own call where it runs its share."""
    replicas = cfg.cluster.replicas
    if replicas == 1 or share is not None:
        return stages.call(name, step)
    return gather([stages.submit(name, step, replica=r) for r in range(replicas)])[0]


def gather(futures: list, fail_fast: bool = True) -> list:
    """The results of `futures` in order. fail_fast: the first failure is raised as soon as it happens, not after the
    futures before it (a replica's failed stage would otherwise wait behind ranks stuck in a collective with it).
    Otherwise (calls that do not wait for each other, as a round of generate calls) every future ends first, so a
    replica's chunk is finished and stored (Cached when the step runs again) though another replica's failed."""
    finished: queue.Queue = queue.Queue()
    for future in futures:
        future.add_done_callback(finished.put)
    first_error = None
    for _ in futures:
        future = finished.get()
        if fail_fast:
            future.result()  # raises that future's error
        elif first_error is None:
            try:
                future.result()
            except Exception as e:  # noqa: BLE001 - raised once the others have ended
                first_error = e
    if first_error is not None:
        raise first_error
    return [future.result() for future in futures]


def settle(engines: EngineHandle) -> None:
    """After a failed stage: commit the writes queued before the failure on every replica, one after the other, so a
    retry reuses them. A failure of the writer is logged, not raised over the stage's own error; a replica that died
    took its queued writes with it."""
    for replica in range(engines.config.cluster.replicas):
        try:
            engines.run_one("trainer", replica, settle_here)
        except ReplicaLost:
            continue
        except Exception as e:  # noqa: BLE001 - the stage's error is the one to raise
            log.error("diffrl: committing the writes made before the failure failed too: %s", e)


def settle_here(engines: Engines) -> None:
    """settle in the process that holds the engines. In one process its running rollouts and rewards end first; a
    replica does not wait for its run-ahead worker, which may wait in a collective for the replica that failed."""
    memory = engines.memory
    if memory is None:
        return
    if world()[1] > 1:
        memory.release_writes()
        memory.writer.flush()
    else:
        memory.drain()
    if memory.ahead is not None:
        memory.ahead.forget_failures()  # a retry in this process runs the failed stage again


def set_first_step(engines: Engines, step: int) -> None:
    """Where the engines live: steps after `step` cannot have rows from an earlier process (a resume)."""
    if engines.memory is not None:
        engines.memory.first_step = step


def drain(engines: Engines) -> None:
    """Where the engines live: the run-ahead, rollouts, rewards and every queued write end (the run's last step)."""
    if engines.memory is not None:
        engines.memory.drain()


def step_metrics(
    cfg: Any,
    generated: list[Generated],
    scored: list[Scored],
    advantaged: Advantaged | None,
    updated: Updated,
    synced: Synced,
    *,
    seconds: float,
    reward_wait: float,
) -> dict[str, float]:
    """verl's and flow_grpo's metric names: rewards, advantages (none for SFT), actor, timings; perf/* is per step as
    the run sees it (StepClock), set by whoever runs the steps."""
    images = sum(g.rows for g in generated)
    reward_s = sum(s.seconds for s in scored)
    metrics = {**(advantaged.metrics if advantaged else {}), **updated.metrics, **synced.metrics}
    metrics.update(
        {
            "timing_s/generate": sum(g.seconds for g in generated),
            "timing_s/generate_wait": sum(g.waited for g in generated),
            "timing_s/reward": reward_s,
            "timing_s/reward_wait": reward_wait,
            # share of the reward time hidden behind the rollout (1 = fully overlapped)
            "timing_s/reward_overlap": max(0.0, 1.0 - reward_wait / reward_s) if reward_s > 0 else 1.0,
            "timing_s/step": seconds,
            "reward/excluded": float(sum(s.excluded for s in scored)),
            "rollout/prefetched_chunks": float(synced.prefetched),
            "rollout/samples": float(images),
            "perf/gpus": float(_engine_gpus(cfg)),
        }
    )
    measured = [s for s in scored if s.image_stats]  # guard/*: the means over the step's images
    sums = {name: sum(s.image_stats[name] for s in measured) for name in (measured[0].image_stats if measured else {})}
    metrics.update(stat_metrics(sums, sum(s.rows for s in measured)))
    for stage in ("generate", "reward", "update_actor"):
        key = f"timing_s/{stage}"
        if key in metrics and images:
            metrics[f"timing_per_image_ms/{stage}"] = 1000.0 * metrics[key] / images
    return metrics


class StepClock:
    """Seconds per step as a run sees them: from the end of one step to the end of the next (so the work between
    steps counts, and a rollout that ran ahead of its step is not double counted), leaving out what runs inside
    `excluded()` (validation)."""

    def __init__(self):
        self._last = time.perf_counter()
        self._excluded = 0.0

    @contextlib.contextmanager
    def excluded(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - started

    def lap(self) -> float:
        now = time.perf_counter()
        seconds = now - self._last - self._excluded
        self._last, self._excluded = now, 0.0
        return seconds


def add_perf(metrics: dict[str, float], seconds: float) -> dict[str, float]:
    """perf/time_per_step, perf/throughput (images/GPU/s, over perf/gpus), perf/images_per_s and
    timing_s/unaccounted of a step that took `seconds` as the run saw it."""
    metrics["perf/time_per_step"] = seconds
    metrics["timing_s/step_total"] = seconds
    images = metrics.get("rollout/samples", 0.0)
    gpus = metrics.get("perf/gpus") or 1
    metrics["perf/images_per_s"] = images / seconds if seconds > 0 else 0.0
    metrics["perf/throughput"] = images / seconds / gpus if seconds > 0 else 0.0
    staged = sum(metrics.get(f"timing_s/{stage}", 0.0) for stage in ACCOUNTED)
    metrics["timing_s/unaccounted"] = seconds - staged
    return metrics


# The stage times a step's time is made of when nothing overlaps; what is left is orchestration and bookkeeping
# (timing_s/unaccounted: negative where the run-ahead overlapped a stage with the flow's bookkeeping).
ACCOUNTED = ("generate", "reward_wait", "update_actor", "checkpoint", "writer_wait", "sync_weights")


def _engine_gpus(cfg: Any) -> int:
    """GPUs the run's model engines hold: its replicas (ray), or one (local: one process on one device, however many
    the machine has). The Ray driver's own view of its machine's GPUs says nothing of the run's."""
    return cfg.cluster.replicas if cfg.cluster.mode == "ray" else 1
