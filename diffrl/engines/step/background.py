"""Work a step hands off its critical path: one ordered worker thread per kind of work.

`Background` runs submitted calls one at a time, in submission order, on its own thread (or inline, in the
caller, when `inline=True`: Ray mode, where the next stage may run in another process and must find the
data committed). Order is what makes it safe to write a step's durable state behind the GPU's back: rows,
then rewards, then advantages, then the checkpoint that names the step done. A crash leaves a prefix of
that sequence on disk, which resume reads as "the step in flight" (diffrl/flows/train.py).

After a failed call the worker runs nothing more (a checkpoint must never commit a step whose rows failed
to write) and the next `submit`, `wait` or `flush` raises the failure in the caller, naming what failed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from diffrl.engines import trace


class BackgroundError(RuntimeError):
    """A background call failed; raised in the stage that next touches the worker."""


class Background:
    """An ordered queue of calls run on one daemon thread; each call is tagged with the RL step it serves."""

    def __init__(self, name: str, *, inline: bool = False, nice: int = 0):
        self.name, self.inline, self.nice = name, inline, nice
        self._queue: deque[tuple[int, str, Callable, tuple, Future]] = deque()
        self._cond = threading.Condition()
        self._failure: BaseException | None = None
        self._failed_what = ""
        self._busy_tag: int | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- the caller's side -------------------------------------------------------------------------
    def submit(self, tag: int, what: str, fn: Callable, *args: Any) -> Future:
        """Queue `fn(*args)` after everything already queued; `what` names it in errors and progress."""
        self._raise_failure()
        future: Future = Future()
        if self.inline:
            run_into(future, fn, args)
            if future.exception() is not None:
                raise future.exception()
            return future
        with self._cond:
            self._queue.append((tag, what, fn, args, future))
            self._closed = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=f"diffrl-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return future

    def call(self, tag: int, what: str, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` after everything queued before it, and its result (a read that must see the writes)."""
        return self.submit(tag, what, fn, *args).result()

    def wait(self, tag: int) -> None:
        """Block until every call tagged <= `tag` has run (backpressure: the writer may lag, not run away)."""
        with self._cond:
            self._cond.wait_for(lambda: self._failure is not None or not any(t <= tag for t in self._pending_tags()))
        self._raise_failure()

    def flush(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty (at most `timeout` seconds: then False); raise the first failure."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._failure is not None or not self._pending_tags(), timeout)
        self._raise_failure()
        return done

    def close(self) -> None:
        """Let the worker thread end once the queue is empty (later submits start a new one)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def pending(self) -> int:
        """Calls queued or running."""
        with self._cond:
            return len(self._pending_tags())

    def _pending_tags(self) -> list[int]:
        tags = [entry[0] for entry in self._queue]
        return tags + ([self._busy_tag] if self._busy_tag is not None else [])

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise BackgroundError(
                f"background {self.name} failed in {self._failed_what}: {type(self._failure).__name__}: {self._failure}"
            ) from self._failure

    # ---- the worker's side -------------------------------------------------------------------------
    def _work(self) -> None:
        if self.nice:  # Linux: a thread's own priority; threads it starts (PNG encoders) inherit it
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    self._thread = None
                    return
                tag, what, fn, args, future = self._queue.popleft()
                self._busy_tag = tag
            with trace.span(f"{self.name}: {what}"):
                run_into(future, fn, args)
            with self._cond:
                self._busy_tag = None
                if future.exception() is not None and self._failure is None:
                    self._failure, self._failed_what = future.exception(), what
                    for *_, skipped in self._queue:  # nothing after a failure may run
                        error = BackgroundError(f"skipped after {what} failed")
                        error.__cause__ = self._failure  # whichever call the flow awaits first names the cause
                        skipped.set_exception(error)
                    self._queue.clear()
                self._cond.notify_all()


def run_into(future: Future, fn: Callable, args: tuple) -> None:
    """Run fn(*args) into `future`: its result, or the exception it raised."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
        future.set_exception(e)
