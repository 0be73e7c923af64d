"""Asynchronous reward pool: scores rollout chunks while the rollout keeps producing.

    with RewardPool(config) as pool:
        for chunk_id, chunk in enumerate(rollout_chunks()):    # the producer
            pool.submit(chunk_id, chunk.images, chunk.prompts, chunk.metadata)
        outputs = pool.results()                                # {chunk_id: RewardOutput}
        metrics = pool.overlap_stats()

- `workers` scorers, each owning its own MultiReward (its own diffrl/models/clients): in threads, or
  in spawned processes (mode "process"; never fork: Lance and CUDA do not survive it).
  Everything a scorer needs is built in __init__, so a missing weight folder fails there.
- Back-pressure: at most `max_pending_chunks` chunks are submitted-but-unfinished; submit
  blocks beyond that, so a fast producer cannot pile images up in memory.
- Per-function batching: MultiReward cuts each chunk into each reward's own batch_size.
- The scoring logic is MultiReward alone; a Ray actor holding one MultiReward is the cluster
  variant of a scorer (diffrl/engines/cluster.py), with the same RewardOutput results.

Overlap accounting (wall-clock, monotonic clock, shared by processes on one host):
  timing_s/reward              union of the intervals during which some chunk was being scored
  timing_s/reward_wait         time the caller spent inside results()
  timing_s/reward_backpressure time the caller spent blocked inside submit()
  timing_s/reward_overlap      the part of timing_s/reward that ran while the producer was
                               working (before results(), outside blocked submits), 0..1
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from diffrl.engines.reward.base import RewardError, RewardOutput, to_uint8_numpy
from diffrl.engines.reward.multi import MultiReward, RewardConfig

logger = logging.getLogger(__name__)

Interval = tuple[float, float]
ScoredChunk = tuple[RewardOutput, float, float]  # output, scoring start, scoring end

# In a spawned worker process: the process's scorer, or the error that building it raised.
_PROCESS_SCORER: MultiReward | None = None
_PROCESS_INIT_ERROR: BaseException | None = None


def _init_process(config: RewardConfig) -> None:
    """Worker-process initializer; keeps a build error so the first chunk reports it verbatim
    (an initializer that raises only says 'BrokenProcessPool')."""
    global _PROCESS_SCORER, _PROCESS_INIT_ERROR
    try:
        _PROCESS_SCORER = MultiReward(config)
    except BaseException as e:  # noqa: BLE001 - re-raised on the first task
        _PROCESS_INIT_ERROR = e


def _score_in_process(images, prompts: list[str], metadata: list[dict]) -> ScoredChunk:
    if _PROCESS_INIT_ERROR is not None:
        raise _PROCESS_INIT_ERROR
    start = time.monotonic()
    output = _PROCESS_SCORER(images, prompts, metadata)
    return output, start, time.monotonic()


def _ping_process() -> bool:
    if _PROCESS_INIT_ERROR is not None:
        raise _PROCESS_INIT_ERROR
    return True


def _score_in_thread(scorers: "queue.Queue[MultiReward]", images, prompts, metadata) -> ScoredChunk:
    scorer = scorers.get()  # one scorer per running chunk: models are never shared by threads
    try:
        start = time.monotonic()
        output = scorer(images, prompts, metadata)
        return output, start, time.monotonic()
    finally:
        scorers.put(scorer)


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint union of intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_length(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two disjoint-interval lists."""
    return sum(max(0.0, min(a_end, b_end) - max(a_start, b_start)) for a_start, a_end in a for b_start, b_end in b)


class RewardPool:
    """Owns the scorers (threads or spawned processes) and the bookkeeping of submitted chunks."""

    def __init__(self, config: RewardConfig):
        self.config = config
        self._slots = threading.BoundedSemaphore(config.max_pending_chunks)
        self._futures: dict[int, Future] = {}
        self._blocked: list[Interval] = []
        self._stats: dict[str, float] = {}
        self._first_submit: float | None = None
        self.names = [c.name for c in config.components]
        self._executor = self._start_executor(config)

    def _start_executor(self, config: RewardConfig) -> Executor:
        if config.mode == "thread":
            # build every scorer now, in this thread: start-up errors surface from the constructor
            self._scorers: queue.Queue[MultiReward] = queue.Queue()
            for _ in range(config.workers):
                self._scorers.put(MultiReward(config))
            return ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="reward")
        executor = ProcessPoolExecutor(
            max_workers=config.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_process,
            initargs=(config,),
        )
        try:  # every worker builds the same config, so one ping surfaces a build error now
            executor.submit(_ping_process).result(timeout=config.timeout_s)
        except BaseException:
            executor.shutdown(wait=True, cancel_futures=True)
            raise
        return executor

    def submit(self, chunk_id: int, images, prompts: list[str], metadata: list[dict] | None = None) -> None:
        """Queues a chunk for scoring; blocks while max_pending_chunks chunks are unfinished."""
        if chunk_id in self._futures:
            raise ValueError(f"chunk_id {chunk_id} was already submitted since the last results()")
        images = to_uint8_numpy(images)  # fail in the producer, not later in a worker
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        waited_from = time.monotonic()
        self._first_submit = waited_from if self._first_submit is None else self._first_submit
        self._slots.acquire()
        waited_to = time.monotonic()
        if waited_to - waited_from > 1e-4:
            self._blocked.append((waited_from, waited_to))
        try:
            if self.config.mode == "thread":
                future = self._executor.submit(_score_in_thread, self._scorers, images, prompts, metadata)
            else:
                future = self._executor.submit(_score_in_process, images, prompts, metadata)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._futures[chunk_id] = future

    def results(self) -> dict[int, RewardOutput]:
        """Waits for every chunk submitted since the last call and returns them by chunk id.

        Raises the failure of the lowest failing chunk id as a RewardError naming the chunk and
        the reward, after all chunks have finished (no work is left running behind the caller).
        """
        called_at = time.monotonic()
        deadline = called_at + self.config.timeout_s
        done: dict[int, ScoredChunk] = {}
        failures: dict[int, BaseException] = {}
        for chunk_id in sorted(self._futures):
            try:
                done[chunk_id] = self._futures[chunk_id].result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                pending = sorted(c for c in self._futures if c not in done and c not in failures)
                raise TimeoutError(
                    f"reward pool: chunks {pending} not scored within timeout_s={self.config.timeout_s}"
                ) from None
            except Exception as e:  # collected; the lowest chunk id is raised below
                failures[chunk_id] = e
        finished_at = time.monotonic()
        self._record_stats(done, called_at, finished_at)
        self._futures, self._blocked, self._first_submit = {}, [], None
        if failures:
            chunk_id = min(failures)
            error = failures[chunk_id]
            name = getattr(error, "reward_name", "?")
            raise RewardError(f"chunk {chunk_id}: reward {name!r}: {type(error).__name__}: {error}", name) from error
        return {chunk_id: scored[0] for chunk_id, scored in done.items()}

    def _record_stats(self, done: dict[int, ScoredChunk], called_at: float, finished_at: float) -> None:
        busy = union([(start, end) for _, start, end in done.values()])
        busy_s = sum(end - start for start, end in busy)
        producer = [(self._first_submit, called_at)] if self._first_submit is not None else []
        hidden_s = overlap_length(busy, producer) - overlap_length(busy, union(self._blocked))
        self._stats = {
            "timing_s/reward": busy_s,
            "timing_s/reward_wait": finished_at - called_at,
            "timing_s/reward_backpressure": sum(end - start for start, end in self._blocked),
            "timing_s/reward_overlap": min(1.0, max(0.0, hidden_s / busy_s)) if busy_s > 0 else 0.0,
        }

    def overlap_stats(self) -> dict[str, float]:
        """Timing of the last results() round (see the module docstring); empty before one."""
        return dict(self._stats)

    def close(self) -> None:
        """Stops the workers; chunks not yet started are dropped."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
