"""The step in flight, handed from stage to stage inside one process (docs/concepts.md, "The step in flight").

When the rollout, the reward and the trainer live in one process (`cluster.mode: local`), a chunk's
trajectories go from `generate` to `score` and `update_actor` in memory, and the trajectory store is written
behind them by one ordered background writer (diffrl/engines/step/background.py): rows, rewards, advantages, then the
checkpoint. Nothing waits for Lance on the critical path; a crash leaves a prefix of that order on disk, and
the stages fall back to the store for whatever this process does not hold (a resumed step, or another
process's output in Ray mode, where every write is inline).

More workers keep the GPU busy while the flow does its bookkeeping:
- the reward worker scores each rollout sub-batch as soon as it is decoded, while the next one denoises
  (streamed rewards; `rollout.batch_size` below `rollout.chunk_size` gives sub-batches);
- the rollout worker starts the next step's chunks right after the weight sync (prefetch), so the Prefect
  subflow, MLflow and retention of one step overlap the next step's sampling. Same weights, prompts and
  seeds as sampling on demand: the samples are identical.
  An asynchronous run (run.async) starts it earlier, when the update starts, on the behaviour copy of the policy
  (the weights of the last sync): the next step's sampling overlaps this step's update.
- the run-ahead worker (diffrl/engines/step/ahead.py) then runs that step's rewards, advantages and update without
  waiting for the flow's tasks, which receive its records.

Legend: B samples of a chunk.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from diffrl.engines import trace
from diffrl.engines.step.ahead import RunAhead
from diffrl.engines.step.background import Background, run_into
from diffrl.engines.trajectories import Trajectories


@dataclass
class ChunkRewards:
    """Rewards of one chunk, aligned with its rows: scores (B,) NaN where excluded, valid (B,), components
    {name: (B,)}, the reward's info (per-sample lists) and the seconds the reward computed."""

    scores: torch.Tensor
    valid: torch.Tensor
    components: dict[str, torch.Tensor]
    info: dict[str, list]
    seconds: float


class StepMemory:
    """One process's hand-off between stages, its background writer and its rollout/reward workers."""

    def __init__(self, *, asynchronous: bool):
        self.asynchronous = asynchronous
        # nice 10: the writer's CPU work (PNG, Arrow) yields to the reward and the rollout's kernel launches
        self.writer = Background("writer", inline=not asynchronous, nice=10)
        # retention (diffrl/engines/step/retention.py) rewrites and merges whole tables, seconds every few steps: on its
        # own worker, which the writer hands it to in order, so the next steps' rows never queue behind it
        self.janitor = Background("janitor", inline=not asynchronous, nice=10)
        self._rollouts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffrl-rollout")
        self._rewards = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffrl-reward")
        self._lock = threading.Lock()
        self._chunks: dict[tuple[int, int], Future] = {}  # (step, chunk) -> Future[(Trajectories, s)]
        # (step, chunk) -> [(rows of the sub-batch, Future[(RewardOutput, s)])] in submission order
        self._streamed: dict[tuple[int, int], list[tuple[list[int], Future]]] = {}
        self._rewards_done: dict[tuple[int, int], ChunkRewards] = {}
        self._advantages: dict[int, torch.Tensor] = {}
        # step -> (rewards (S,), components {name: (S,)}, valid (S,)) of the whole step: an engine replica holds its
        # own chunks, and the step's S samples once the replicas exchanged them (diffrl/engines/step/replicas.py)
        self._step_rewards: dict[int, tuple] = {}
        self._held: list[tuple] = []  # the step's durable writes, until the update releases them
        # The first step of this process: earlier-or-equal steps may have durable state from a previous
        # process (resume), later ones cannot, so only those check the store before sampling.
        self.first_step = 0
        # each stage of a step runs once here, the next step's ahead of the flow (diffrl/engines/step/ahead.py)
        self.ahead = RunAhead() if asynchronous else None
        self._closers: list[Callable[[], None]] = []  # what ends with the run (close_with)
        self._stopped = False  # interrupted (stop): nothing waits for the worker threads any more

    # ---- rollouts --------------------------------------------------------------------------------------
    def start_rollout(self, step: int, chunk: int, rollout: Callable[[], Trajectories]) -> None:
        """Run `rollout()` on the rollout worker (the next step's chunks, right after the weight sync); inline,
        in the caller, when this process's stages are not asynchronous (a Ray actor)."""
        with self._lock:
            if (step, chunk) in self._chunks:
                return
            if self.asynchronous:
                self._chunks[(step, chunk)] = self._rollouts.submit(_timed, rollout, "rollout", step, chunk)
                return
        future: Future = Future()
        run_into(
            future, _timed, (rollout, "rollout", step, chunk)
        )  # a failure is raised by chunk(), as a worker's would be
        with self._lock:
            self._chunks[(step, chunk)] = future

    def wait_rollouts(self) -> None:
        """Block until every rollout started here has ended (an asynchronous run's weight sync: the behaviour copy
        the rollouts sample with is overwritten next). A failure is not raised here: `chunk` raises it to the stage
        that reads the chunk."""
        with self._lock:
            pending = list(self._chunks.values())
        for future in pending:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - reported by the generate stage (chunk)
                pass

    def put_chunk(self, step: int, chunk: int, traj: Trajectories, seconds: float) -> None:
        future: Future = Future()
        future.set_result((traj, seconds))
        with self._lock:
            self._chunks[(step, chunk)] = future

    def has_chunk(self, step: int, chunk: int) -> bool:
        with self._lock:
            return (step, chunk) in self._chunks

    def chunk(self, step: int, chunk: int) -> tuple[Trajectories, float] | None:
        """(trajectories, rollout seconds) of a chunk held here, waiting for a prefetched one; None if absent.
        A failed rollout raises its error here (and is forgotten, so a retry samples again)."""
        with self._lock:
            future = self._chunks.get((step, chunk))
        if future is None:
            return None
        try:
            return future.result()
        except BaseException:
            with self._lock:
                self._chunks.pop((step, chunk), None)
            raise

    def chunks(self, step: int, count: int) -> list[Trajectories] | None:
        """All `count` chunks of a step in chunk order, or None unless every one is held here."""
        parts = [self.chunk(step, c) for c in range(count)]
        return None if any(p is None for p in parts) else [p[0] for p in parts]

    # ---- durable writes --------------------------------------------------------------------------------
    def queue_write(self, tag: int, what: str, fn: Callable, *args) -> None:
        """A durable write of the step in flight. Held until `release_writes` (the update releases them: the GPU
        then trains while the writer works, instead of the writer's CPU work slowing the reward and the
        rollout's kernel launches); written at once where writes are inline (Ray)."""
        if not self.asynchronous:
            self.writer.submit(tag, what, fn, *args)
            return
        with self._lock:
            self._held.append((tag, what, fn, args))

    def release_writes(self) -> None:
        """Queue the held writes on the writer, in the order they were made."""
        with self._lock:
            held, self._held = self._held, []
        for tag, what, fn, args in held:
            self.writer.submit(tag, what, fn, *args)

    # ---- rewards ---------------------------------------------------------------------------------------
    def stream_reward(self, step: int, chunk: int, rows: list[int], score: Callable[[], object]) -> None:
        """Score one decoded sub-batch of a chunk (its `rows` of the chunk) on the reward worker (while the rollout
        goes on)."""
        with self._lock:
            future = self._rewards.submit(_timed, score, "reward", step, chunk)
            self._streamed.setdefault((step, chunk), []).append((list(rows), future))

    def reset_stream(self, step: int, chunk: int) -> None:
        """Forget a chunk's streamed sub-batches (its rollout starts again)."""
        with self._lock:
            self._streamed.pop((step, chunk), None)

    def take_streamed(self, step: int, chunk: int) -> tuple[list, list[int], float] | None:
        """(reward outputs of the chunk's sub-batches in submission order, the chunk rows they score in that order,
        their compute seconds), or None."""
        with self._lock:
            streamed = self._streamed.pop((step, chunk), None)
        if not streamed:
            return None
        results = [f.result() for _, f in streamed]
        rows = [r for batch, _ in streamed for r in batch]
        return [out for out, _ in results], rows, sum(s for _, s in results)

    def put_step_rewards(self, step: int, rewards: tuple) -> None:
        with self._lock:
            self._step_rewards[step] = rewards

    def step_rewards(self, step: int) -> tuple | None:
        """The whole step's (rewards, components, valid) exchanged between replicas, or None."""
        with self._lock:
            return self._step_rewards.get(step)

    def put_rewards(self, step: int, chunk: int, rewards: ChunkRewards) -> None:
        with self._lock:
            self._rewards_done[(step, chunk)] = rewards

    def rewards(self, step: int, count: int) -> list[ChunkRewards] | None:
        """The rewards of all `count` chunks of a step in chunk order, or None unless every one is held here."""
        with self._lock:
            parts = [self._rewards_done.get((step, c)) for c in range(count)]
        return None if any(p is None for p in parts) else parts

    def rewards_of(self, step: int, chunks: list[int]) -> tuple | None:
        """(scores, components, valid) of `chunks` of a step, concatenated in that order; None unless all are held."""
        with self._lock:
            parts = [self._rewards_done.get((step, c)) for c in chunks]
        if any(p is None for p in parts):
            return None
        return cat_rewards([(p.scores, p.components, p.valid) for p in parts])

    # ---- advantages ------------------------------------------------------------------------------------
    def put_advantages(self, step: int, advantages: torch.Tensor) -> None:
        with self._lock:
            self._advantages[step] = advantages

    def advantages(self, step: int) -> torch.Tensor | None:
        with self._lock:
            return self._advantages.get(step)

    # ---- lifetime --------------------------------------------------------------------------------------
    def release_before(self, step: int) -> None:
        """Drop what steps before `step` handed over (their durable copies are queued or written)."""
        with self._lock:
            for table in (self._chunks, self._streamed, self._rewards_done):
                for key in [k for k in table if k[0] < step]:
                    table.pop(key)
            for table in (self._advantages, self._step_rewards):
                for key in [k for k in table if k < step]:
                    table.pop(key)

    def drain(self) -> None:
        """Wait for the run-ahead, running rollouts and rewards (their errors are the stages' to raise), then the
        writer and the retention it handed on."""
        if self.ahead is not None:
            self.ahead.wait()
        with self._lock:
            pending = list(self._chunks.values()) + [f for fs in self._streamed.values() for _, f in fs]
        for future in pending:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - reported by the stage that reads it
                pass
        self.release_writes()
        self.writer.flush()
        self.janitor.flush()

    def reset(self) -> None:
        """Forget every step held here (after drain): a new flow run of warm engines starts from the store."""
        with self._lock:
            for table in (self._chunks, self._streamed, self._rewards_done, self._advantages, self._step_rewards):
                table.clear()
            self.first_step = 0
        if self.ahead is not None:
            self.ahead.done_before(1 << 62)

    def close_with(self, closer: Callable[[], None]) -> None:
        """Call `closer` when this memory closes, after its threads end: a process the run's engines started (a vLLM
        rollout server) ends with the run, the way the run's worker threads do, also when the run fails."""
        self._closers.append(closer)

    def stop(self, timeout_s: float) -> bool:
        """The run was interrupted: the run-ahead, rollout and reward workers start nothing more (a stage running
        there ends on its own, unwaited), the writes made so far are committed for at most `timeout_s` seconds (in
        order, so what lands is a prefix of them, as after a crash, which a resume reuses), then what close_with
        registered ends (a vLLM server). Returns whether every write landed."""
        self._stopped = True
        if self.ahead is not None:
            self.ahead.stop()
        self._rollouts.shutdown(wait=False, cancel_futures=True)
        self._rewards.shutdown(wait=False, cancel_futures=True)
        try:
            self.release_writes()
            return self.writer.flush(timeout_s)
        except Exception:  # noqa: BLE001 - a failed write is one a resume makes again, as after a crash
            return False
        finally:
            self.close()

    def close(self) -> None:
        """End the worker threads (after drain: nothing queued is dropped by the writer; after stop: without waiting
        for them), then what close_with registered."""
        try:
            if self.ahead is not None:
                self.ahead.close()
            self._rollouts.shutdown(wait=not self._stopped, cancel_futures=True)
            self._rewards.shutdown(wait=not self._stopped, cancel_futures=True)
            self.writer.close()
            self.janitor.close()
        finally:
            closers, self._closers = self._closers, []
            for closer in reversed(closers):
                closer()


def cat_rewards(parts: list[tuple]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(scores, components, valid) of consecutive parts of a step, concatenated; a component a part lacks (an optional
    one that was down there) is NaN on its samples."""
    names = sorted({name for _, components, _ in parts for name in components})
    nan = float("nan")
    components = {name: torch.cat([c.get(name, torch.full_like(s, nan)) for s, c, _ in parts]) for name in names}
    return torch.cat([p[0] for p in parts]), components, torch.cat([p[2] for p in parts])


def _timed(fn: Callable[[], object], name: str, step: int, chunk: int) -> tuple[object, float]:
    started = time.perf_counter()
    with trace.span(name, step=step, chunk=chunk):
        out = fn()
    return out, time.perf_counter() - started
