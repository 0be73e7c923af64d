"""The engines run one step ahead of the flow that records it: in the run's process, or in each Ray engine replica,
where the worker runs that replica's share of the step.

A step's stages are short calls from the flow (Prefect tasks) into warm engines. Between two steps the flow does its
bookkeeping: the step's subflow run ends and the next one starts (Prefect API calls), MLflow, rollout images,
retention. Without the worker the GPU waits for it: the next step's update could only start once the flow had walked
through its generate, score and advantages tasks.

Here every stage of a step runs once per process, by whoever asks first (`RunAhead.once`): the flow's task, or the
run-ahead worker. When the flow has received step k's record and step k's weight sync has started step k+1's
rollout, the worker runs step k+1's stages in order, with the flow's own stage functions (diffrl/engines/step/run.py):
its rewards, advantages, update and checkpoint do not wait for the flow's bookkeeping. The flow's tasks for step k+1
then get the records the worker made (or make them, if they ask first): the same stages, run once, in the same order,
recorded by the same Prefect tasks. The worker is never more than one step ahead: it starts step k+1 only after the
flow's `run_step(k)` returned, and never past a validation or the run's last step (no prefetch there).

A stage that fails on the worker fails the flow's task of that stage with the same error; `forget_failures` (after the
step settled) lets a retry in this process run it again.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable

from diffrl.engines import trace
from diffrl.engines.step.background import run_into


class RunAhead:
    """The once-per-process stage runs of the steps in flight, and the worker that runs the next step's stages."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: dict[tuple, Future] = {}  # (stage, step, chunk, replica) -> Future[record]
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffrl-ahead")
        self._jobs: list[Future] = []
        self.stages: Any = None  # the worker's own stage caller (diffrl/engines/step/run.DirectStages), made once
        self._stopping = False

    def once(self, key: tuple[str, int, Hashable, Hashable], run: Callable[[], Any]) -> Any:
        """`run()`'s result for stage run `key` = (stage, step, chunk, replica): run here if nobody ran it yet in this
        process, else the first run's result (waiting for it, raising its error)."""
        with self._lock:
            future = self._runs.get(key)
            owner = future is None
            if owner:
                future = Future()
                self._runs[key] = future
        if owner:
            run_into(future, self._refuse if self._stopping else run, ())
            return future.result()
        with trace.span(f"wait {key[0]}", step=key[1]):  # the record another thread makes (or made)
            return future.result()

    def start(self, step: int, run: Callable[[], Any]) -> None:
        """Run step `step`'s stages (`run()`) on the worker. Its errors are not raised here: each reaches the flow
        through `once`, in the task of the stage that failed."""

        def job() -> None:
            try:
                run()
            except BaseException:  # noqa: BLE001 - raised to the flow by the stage's own task (see once)
                pass

        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()] + [self._worker.submit(job)]

    def done_before(self, step: int) -> None:
        """Forget the stage runs of steps before `step` (the flow has their records)."""
        with self._lock:
            for key in [k for k in self._runs if k[1] < step]:
                self._runs.pop(key)

    def wait(self) -> None:
        """Block until the worker's jobs ended (a failed step settles only after them)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.result()

    def forget_failures(self) -> None:
        """Forget the stage runs that failed, so that a retry in this process runs them again."""
        with self._lock:
            for key in [k for k, f in self._runs.items() if f.done() and f.exception() is not None]:
                self._runs.pop(key)

    def stop(self) -> None:
        """The run was interrupted: no stage starts here any more (the one running ends on its own, unwaited)."""
        self._stopping = True
        self._worker.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _refuse() -> None:
        raise RuntimeError("the run is stopping: no stage starts any more")

    def close(self) -> None:
        self._worker.shutdown(wait=not self._stopping, cancel_futures=True)
