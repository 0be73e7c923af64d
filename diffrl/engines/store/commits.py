"""One commit at a time per Lance table, across processes, where the object store cannot arbitrate.

Lance commits a version by writing its manifest with a conditional PUT (`If-None-Match`): of two processes committing
the same version one fails, rebases and commits the next. A store that ignores the condition (moto's S3 server, some
S3-compatible stores) lets the second manifest replace the first, and the first commit's rows are gone with no error
on either side. Several engine replicas append to one run's tables at once, so with the run on an object store their
commits go through a lock every replica reaches (diffrl/engines/commit_lock.py: a named Ray actor). The rows are
written first, by every replica at once; only the commit of their manifest waits for the lock.

`use_lock(root, lock)` gives the lock to every table under `root`; `LanceTable` asks `lock_for(uri)`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from diffrl.engines.store import fs


class CommitLock(Protocol):
    """A lock shared by every process writing the run's tables, one per key (a table's URI)."""

    def hold(self, key: str) -> AbstractContextManager[None]:
        """Held while the block runs; waits for the other holders of `key` first."""
        ...


_LOCKS: dict[str, CommitLock] = {}  # root URI -> the lock of the tables under it


def use_lock(root: str, lock: CommitLock | None) -> None:
    """Commit every table under `root` while holding `lock` (None: Lance's own commits again)."""
    key = str(root).rstrip("/")
    if lock is None:
        _LOCKS.pop(key, None)
    else:
        _LOCKS[key] = lock


def lock_for(uri: str) -> CommitLock | None:
    """The lock `use_lock` gave the longest root holding `uri`, or None."""
    root = fs.longest_root(_LOCKS, uri)
    return _LOCKS[root] if root is not None else None
