"""The ordered background worker the step core writes through: order, failure handling, waits."""

from __future__ import annotations

import threading

import pytest

from diffrl.engines.step.background import Background, BackgroundError


def test_calls_run_in_submission_order_on_one_thread():
    worker, seen, threads = Background("test"), [], set()

    def note(i):
        seen.append(i)
        threads.add(threading.current_thread().name)
        return i * i

    futures = [worker.submit(i, f"call {i}", note, i) for i in range(50)]
    worker.flush()
    assert seen == list(range(50)) and [f.result() for f in futures] == [i * i for i in range(50)]
    assert threads == {"diffrl-test"} and worker.pending() == 0


def test_a_failure_stops_the_queue_and_surfaces_in_the_caller():
    """Nothing queued after a failed write may run (a checkpoint must not commit a step whose rows failed)."""
    worker, gate, ran = Background("test"), threading.Event(), []

    def fail():
        gate.wait(5)
        raise OSError("disk full")

    worker.submit(0, "rows of step 0", fail)
    later = worker.submit(0, "checkpoint of step 0", ran.append, "checkpoint")
    gate.set()
    with pytest.raises(BackgroundError, match=r"background test failed in rows of step 0: OSError: disk full"):
        worker.flush()
    assert ran == [] and isinstance(later.exception(), BackgroundError)
    with pytest.raises(BackgroundError, match="disk full"):
        worker.submit(1, "rows of step 1", ran.append, "rows")


def test_wait_returns_once_the_tagged_calls_are_done():
    worker, gate, done = Background("test"), threading.Event(), []
    worker.submit(1, "step 1", done.append, 1)
    worker.submit(2, "step 2 (blocked)", gate.wait, 5)
    worker.wait(1)  # returns although the step-2 call still waits
    assert done == [1] and worker.pending() == 1
    gate.set()
    worker.flush()
    assert worker.pending() == 0


def test_inline_runs_in_the_caller_and_raises_there():
    worker = Background("test", inline=True)
    assert worker.call(0, "read", threading.current_thread) is threading.current_thread()
    with pytest.raises(ZeroDivisionError):
        worker.submit(0, "bad", lambda: 1 / 0)
    worker.flush()  # an inline failure is the caller's: the worker stays usable
    assert worker.call(0, "after", lambda: 7) == 7


def test_flush_with_a_timeout_says_whether_everything_landed():
    """An interrupted run waits a bounded time for its writes (diffrl/flows/interrupts.py), then leaves the rest."""
    worker, gate = Background("test"), threading.Event()
    worker.submit(0, "slow write", gate.wait, 5)
    assert worker.flush(timeout=0.05) is False and worker.pending() == 1
    gate.set()
    assert worker.flush(timeout=5) is True and worker.pending() == 0


def test_a_call_skipped_after_a_full_disk_reports_the_full_disk():
    """Whichever call the flow awaits first, the command's one line names the failure and its advice: a call skipped
    after a write that hit a full disk carries that error as its cause."""
    import errno

    from diffrl.flows.errors import report

    worker, gate = Background("test"), threading.Event()

    def fail():
        gate.wait(5)
        raise OSError(errno.ENOSPC, "No space left on device")

    worker.submit(0, "checkpoint of step 1", fail)
    later = worker.submit(0, "rows of step 2", print)
    gate.set()
    with pytest.raises(BackgroundError):
        worker.flush()
    skipped = later.exception()
    assert str(skipped) == "skipped after checkpoint of step 1 failed" and isinstance(skipped.__cause__, OSError)
    assert "(the disk is full: free space, then rerun the same command to resume)" in report(skipped).line
