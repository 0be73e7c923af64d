"""The run's commit lock on a Ray cluster: a named actor `<run>/commits` that every engine replica (and the driver)
asks before it commits to one of the run's Lance tables on an object store (why: diffrl/engines/store/commits.py).

A grant is a lease: a holder that dies holding it (its node lost mid-commit) blocks the table for `LEASE_S` at most.
The actor holds no GPU and no CPU; `diffrl cluster stop <run>` removes it with the run's other actors.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, Iterator

from diffrl.engines.store import commits, fs

LEASE_S = 120.0  # far above one manifest commit (well under a second), so a live holder never loses its grant
WAIT_S = 600.0  # a grant not given in this long is an error naming the table
POLL_S = 0.005


class CommitLockService:
    """The actor body: who holds which key, until when."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, float]] = {}  # key -> (holder's token, lease end on this clock)
        self.grants = 0

    def acquire(self, key: str, token: str, lease_s: float = LEASE_S) -> bool:
        """Grant `key` to `token` when nobody holds it (or the holder's lease ran out); False otherwise."""
        now = time.monotonic()
        holder = self._held.get(key)
        if holder is not None and holder[0] != token and holder[1] > now:
            return False
        self._held[key] = (token, now + lease_s)
        self.grants += 1
        return True

    def release(self, key: str, token: str) -> None:
        if self._held.get(key, ("",))[0] == token:
            del self._held[key]

    def describe(self) -> dict:
        """What `diffrl cluster status` shows: where the lock lives, its grants so far, the tables held now."""
        import os

        import ray

        node = ray.get_runtime_context().get_node_id()
        return {"node": node, "pid": os.getpid(), "commit_lock": {"grants": self.grants, "held": sorted(self._held)}}


class RayCommitLock:
    """The client side (a `commits.CommitLock`): polls the run's service until it grants the key."""

    def __init__(self, actor: Any, timeout_s: float = WAIT_S):
        self.actor, self.timeout_s = actor, timeout_s

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        import ray

        token, deadline = uuid.uuid4().hex, time.monotonic() + self.timeout_s
        while not ray.get(self.actor.acquire.remote(key, token), timeout=60):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key}: the run's commit lock was not granted in {self.timeout_s:.0f} s")
            time.sleep(POLL_S)
        try:
            yield
        finally:
            ray.get(self.actor.release.remote(key, token), timeout=60)


def serialise_commits(config: Any) -> None:
    """With the run on an object store, commit its tables under the run's lock from this process (the lock's actor
    is started by whichever process asks first). A local run folder needs none: Lance commits a local table with an
    atomic rename."""
    if not fs.is_uri(config.run.root):
        return
    import ray

    from diffrl.engines.actors import NAMESPACE, actor_name

    name = actor_name(config.run.name, "commits")
    service = (
        ray.remote(CommitLockService)
        .options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0)
        .remote()
    )
    commits.use_lock(config.run_dir, RayCommitLock(service))
