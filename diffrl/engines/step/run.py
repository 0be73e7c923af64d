"""One RL step, the only place its stages are sequenced: the Prefect flow (diffrl/flows/rl_step.py) runs it with its
stages as Prefect tasks, the benchmarks and tests run it with the stages called directly (`DirectStages`).

    online:  for each chunk: generate(chunk) ; score(chunk) runs while the next chunk generates
    offline: offline_pairs(step)   -- offline DPO's pairs from the VAE-latent cache
    advantages(step) -> update_actor(step) (+ checkpoint) -> sync_weights(step) (+ the next step's rollout)

With N engine replicas (`cluster.gpus: N`), replica r generates the r-th N-th of the step's chunks: the chunks of a
round (one per replica) generate at once, each scored while the next round generates; the advantages are normalised
over the whole step (the reward actor reads every replica's rewards), exactly as with one replica; update_actor and
sync_weights are one call on every replica at once (their trainers are one FSDP2 group). A stage call names the replica
it runs on, so each replica's part of a stage is its own Prefect task, retried like any other.

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
from diffrl.engines.step import generate as sample_stages
from diffrl.engines.step import update as learn_stages
from diffrl.engines.step.plan import num_chunks, replica_chunks
from diffrl.engines.step.records import Advantaged, Generated, Scored, StepResult, Synced, Updated

log = logging.getLogger("diffrl")


def sync_engines(
    engines: Any, step: int, chunk: int = 0, replica: int | None = None, prefetch_next: bool = True
) -> Synced:
    """Bring the rollout to the trainer's weights wherever they live (in-process or colocated actor: the shared
    adapter; split actors: the changed tensors travel trainer -> rollout; a replica: its own copy, all replicas at
    once, so `replica` names one of the calls that must run together)."""
    if engines.split:
        return engines.pipe(
            ("trainer", learn_stages.export_for_rollout), ("rollout", learn_stages.load_from_trainer), step
        )
    if replica is None:
        return engines.run("trainer", learn_stages.sync, step, 0, prefetch_next)
    return engines.run_one("trainer", replica, learn_stages.sync, step, 0, prefetch_next)


def _on(role: str, fn: Callable) -> Callable:
    """The driver-side call of a stage: `fn(engines, step, chunk)` where its role lives (on every trainer rank for
    "trainer"); `replica` picks one actor of the role instead (one engine replica, or one rank's part of a collective
    stage)."""

    def call(engines: Any, step: int, chunk: int = 0, replica: int | None = None):
        if replica is None:
            return engines.run(role, fn, step, chunk)
        return engines.run_one(role, replica, fn, step, chunk)

    call.__name__ = fn.__name__
    return call


def _score(engines: Any, step: int, chunk: int = 0, replica: int | None = None) -> Scored:
    """The score stage on the reward actor of chunk `chunk` (chunk c on actor c % cluster.reward_actors)."""
    return engines.run_one("reward", chunk, sample_stages.score, step, chunk)


def _once(name: str, call: Callable) -> Callable:
    """`call` run once per (stage, step, chunk, replica) where the engines run ahead of the flow (one process,
    diffrl/engines/step/ahead.py): a second caller of the same stage run gets the first one's record."""

    def staged(engines: Any, step: int, chunk: int = 0, replica: int | None = None):
        def run():
            with trace.span(name, step=step, chunk=chunk, replica=replica):
                return call(engines, step, chunk, replica)

        ahead = _run_ahead(engines)
        return run() if ahead is None else ahead.once((name, step, chunk, replica), run)

    staged.__name__ = getattr(call, "__name__", name)
    return staged


def _run_ahead(engines: Any) -> Any:
    memory = getattr(engines, "memory", None)
    return memory.ahead if memory is not None else None


# Stage name -> (driver-side call running the stage where its role lives, the record type it returns).
STAGES: dict[str, tuple[Callable, type]] = {
    name: (_once(name, call), kind)
    for name, (call, kind) in {
        "generate": (_on("rollout", sample_stages.generate), Generated),
        "score": (_score, Scored),
        "offline_pairs": (_on("trainer", sample_stages.offline_pairs), Generated),
        "advantages": (_on("reward", learn_stages.advantages), Advantaged),
        "update_actor": (_on("trainer", learn_stages.update), Updated),
        "sync_weights": (sync_engines, Synced),
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

    def __init__(self, engines: Any):
        self.engines = engines
        # a generate and a score in flight per replica; a collective stage needs a call on every replica at once
        workers = 2 * engines.config.cluster.replicas
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="diffrl-stage")

    def call(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any:
        return STAGES[name][0](self.engines, step, chunk, replica)

    def submit(self, name: str, step: int, chunk: int = 0, replica: int | None = None) -> Any:
        return self._pool.submit(self.call, name, step, chunk, replica)


def run_step(engines: Any, step: int, stages: Stages) -> StepResult:
    """Run RL step `step` on `engines` through `stages`; returns its metrics (DESIGN section 4 names). In one process,
    the next step's stages then start on the run-ahead worker (diffrl/engines/step/ahead.py)."""
    try:
        result, synced = _run_stages(engines, step, stages)
    except BaseException:
        settle(engines)
        raise
    ahead = _run_ahead(engines)
    if ahead is not None:
        ahead.done_before(step)
        # the next step's rollout runs: its other stages follow it now, not after the flow's. Only a rollout started
        # in this process counts: a resumed step's weight sync can come back Cached from Prefect, its record saying
        # that the earlier process prefetched, while here nothing synced yet (a vLLM server just started holds
        # version 0: the run-ahead sampled "version 1" before the resume's own sync, and failed)
        if synced.prefetched and engines.memory.has_chunk(step + 1, 0):
            if ahead.stages is None:
                ahead.stages = DirectStages(engines)
            ahead.start(step + 1, functools.partial(_run_stages, engines, step + 1, ahead.stages))
    return result


def _run_stages(engines: Any, step: int, stages: Stages) -> tuple[StepResult, Synced]:
    """The stages of step `step` in order through `stages`; its record and the weight sync's."""
    cfg = engines.config
    started = time.perf_counter()
    generated: list[Generated] = []
    scored: list[Scored] = []
    reward_wait = 0.0
    if cfg.data.sample_source == "offline":
        generated.append(stages.call("offline_pairs", step))
    else:
        pending = []
        for round_ in _generate_rounds(stages, cfg, step):
            for done in round_:
                generated.append(done)
                pending.append(stages.submit("score", step, done.chunk))  # overlaps with the next round
        rollout_done = time.perf_counter()
        scored = [future.result() for future in pending]
        reward_wait = time.perf_counter() - rollout_done
    advantaged = stages.call("advantages", step)
    updated = _on_every_replica(stages, cfg, "update_actor", step)
    synced = _on_every_replica(stages, cfg, "sync_weights", step)
    seconds = time.perf_counter() - started
    metrics = step_metrics(
        cfg, generated, scored, advantaged, updated, synced, seconds=seconds, reward_wait=reward_wait
    )
    return StepResult(step, metrics), synced


def _generate_rounds(stages: Stages, cfg: Any, step: int):
    """The step's generate calls, a round at a time: one chunk (one replica), or one chunk on each of N replicas at
    once (replica r generating chunks r*K ... r*K + K-1 of the step's N*K: diffrl/engines/step/plan.replica_chunks)."""
    replicas = cfg.cluster.replicas
    if replicas == 1:
        for chunk in range(num_chunks(cfg)):
            yield [stages.call("generate", step, chunk)]
        return
    shares = [replica_chunks(cfg, r) for r in range(replicas)]
    for k in range(len(shares[0])):
        futures = [stages.submit("generate", step, share[k], replica=r) for r, share in enumerate(shares)]
        yield gather(futures, fail_fast=False)  # no collective among them: the chunks that finish are kept


def _on_every_replica(stages: Stages, cfg: Any, name: str, step: int) -> Any:
    """A stage of the replicas' trainer group: one call per replica, all at once (they meet in collectives); rank 0's
    record (metrics are reduced over the ranks already)."""
    replicas = cfg.cluster.replicas
    if replicas == 1:
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


def settle(engines: Any) -> None:
    """After a failed stage: let this process's running rollouts and rewards end and commit the writes queued
    before the failure, so a retry reuses them. A failure of the writer itself is logged, not raised over the
    stage's own error."""
    memory = engines.memory
    if memory is None:
        return
    try:
        memory.drain()
    except Exception as e:  # noqa: BLE001 - the stage's error is the one to raise
        log.error("diffrl: the background writer failed too: %s", e)
    if memory.ahead is not None:
        memory.ahead.forget_failures()  # a retry in this process runs the failed stage again


def step_metrics(
    cfg: Any,
    generated: list[Generated],
    scored: list[Scored],
    advantaged: Advantaged,
    updated: Updated,
    synced: Synced,
    *,
    seconds: float,
    reward_wait: float,
) -> dict[str, float]:
    """DESIGN section 4 names: rewards, advantages, actor, timings; perf/* is per step as the run sees it
    (StepClock), set by whoever runs the steps."""
    images = sum(g.rows for g in generated)
    reward_s = sum(s.seconds for s in scored)
    metrics = {**advantaged.metrics, **updated.metrics, **synced.metrics}
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
    """perf/time_per_step, perf/throughput (images/GPU/s, over perf/gpus) and perf/images_per_s of a step that took
    `seconds` as the run saw it."""
    metrics["perf/time_per_step"] = seconds
    metrics["timing_s/step_total"] = seconds
    images = metrics.get("rollout/samples", 0.0)
    gpus = metrics.get("perf/gpus") or 1
    metrics["perf/images_per_s"] = images / seconds if seconds > 0 else 0.0
    metrics["perf/throughput"] = images / seconds / gpus if seconds > 0 else 0.0
    return metrics


def _engine_gpus(cfg: Any) -> int:
    """GPUs the run's model engines hold: its replicas (ray, colocated), trainers + rollout (ray, split), or one
    (local: one process on one device, however many the machine has). The Ray driver's own view of its machine's
    GPUs says nothing of the run's."""
    if cfg.cluster.mode != "ray":
        return 1
    return cfg.cluster.replicas if cfg.cluster.placement == "colocated" else cfg.cluster.trainers + 1
