"""The run's commit lock (diffrl/engines/commit_lock.py) as the replicas see it: one holder per table at a time, a
holder's lease ends so a lost node cannot block a table for good, and the registry finds a table's lock by its run
root. The actor body is exercised here in one process; tests/cluster/test_multinode.py runs it as a Ray actor with two
replicas committing to a bucket."""

from __future__ import annotations

import time

from diffrl.engines.commit_lock import CommitLockService
from diffrl.engines.store import commits


def test_one_holder_per_table_until_it_releases():
    service = CommitLockService()
    assert service.acquire("s3://b/run/trajectories.lance", "a")
    assert not service.acquire("s3://b/run/trajectories.lance", "b")  # held by a
    assert service.acquire("s3://b/run/rewards.lance", "b")  # another table: its own lock
    assert service.acquire("s3://b/run/trajectories.lance", "a")  # the holder again (renews)
    service.release("s3://b/run/trajectories.lance", "b")  # not b's to release
    assert not service.acquire("s3://b/run/trajectories.lance", "b")
    service.release("s3://b/run/trajectories.lance", "a")
    assert service.acquire("s3://b/run/trajectories.lance", "b")
    assert service.grants == 4


def test_a_lease_that_ran_out_is_granted_to_the_next():
    service = CommitLockService()
    assert service.acquire("t", "lost-holder", lease_s=0.05)
    assert not service.acquire("t", "next")
    time.sleep(0.1)  # the holder's lease ends (a lower bound on time only: no assertion depends on speed)
    assert service.acquire("t", "next")


class _Named:
    def __init__(self, name: str):
        self.name = name

    def hold(self, key: str):  # pragma: no cover - only looked up here
        raise AssertionError


def test_a_table_finds_the_lock_of_the_longest_root_holding_it():
    run, other = _Named("run"), _Named("other")
    commits.use_lock("s3://bucket/runs/a", run)
    commits.use_lock("s3://bucket/runs/ab", other)
    try:
        assert commits.lock_for("s3://bucket/runs/a/trajectories.lance") is run
        assert commits.lock_for("s3://bucket/runs/ab/trajectories.lance") is other
        assert commits.lock_for("s3://bucket/runs/b/trajectories.lance") is None
        commits.use_lock("s3://bucket/runs/a/", None)
        assert commits.lock_for("s3://bucket/runs/a/trajectories.lance") is None
    finally:
        commits.use_lock("s3://bucket/runs/ab", None)
