"""How the step core waits for the replicas' calls of one stage (diffrl/engines/step/run.py gather): a failure of a
collective stage is raised at once, a failed generate round waits for the other replicas' chunks first."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from diffrl.engines.step.run import gather


def _calls(pool: ThreadPoolExecutor, gate: threading.Event, finished: list) -> list:
    """Replica 0 works until `gate` opens; replica 1 fails at once (the injected fault of a retry drill)."""

    def slow():
        assert gate.wait(10), "the gate never opened"
        finished.append(0)
        return "chunk 0"

    def fail():
        raise RuntimeError("injected fault in stage 'generate'")

    return [pool.submit(slow), pool.submit(fail)]


def test_fail_fast_raises_before_the_other_replica_ends():
    """A collective stage: the failure surfaces while replica 0 still runs (it could be stuck waiting for replica 1)."""
    gate, finished = threading.Event(), []
    with ThreadPoolExecutor(2) as pool:
        futures = _calls(pool, gate, finished)
        with pytest.raises(RuntimeError, match="injected fault"):
            gather(futures)
        assert finished == [] and not futures[0].done()
        gate.set()
    assert futures[0].result() == "chunk 0"


def test_a_generate_round_lets_every_replica_end_before_raising():
    """Without fail_fast the failure is raised only after replica 0's chunk is done (its task Completed, so a rerun of
    the step finds it Cached)."""
    gate, finished = threading.Event(), []
    with ThreadPoolExecutor(2) as pool:
        futures = _calls(pool, gate, finished)
        threading.Timer(0.3, gate.set).start()
        with pytest.raises(RuntimeError, match="injected fault"):
            gather(futures, fail_fast=False)
        assert finished == [0] and futures[0].result() == "chunk 0"


def test_results_come_back_in_the_futures_order():
    with ThreadPoolExecutor(3) as pool:
        gate = threading.Event()
        futures = [pool.submit(gate.wait, 10), pool.submit(lambda: 1), pool.submit(lambda: 2)]
        threading.Timer(0.2, gate.set).start()
        assert gather(futures, fail_fast=False) == [True, 1, 2]
        assert gather(futures) == [True, 1, 2]
