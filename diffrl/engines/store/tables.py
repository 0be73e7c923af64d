"""One Lance table handle shared by the trajectory store, the per-sample tables and the caches.

Why a handle and not `lance.dataset(uri)` on every call: memory:// tables live in the object store
of the session that created them, so reopening by URI would find nothing; keeping the dataset
object and calling `checkout_latest()` works for every scheme and is cheaper on object stores.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

# Lance's Rust log defaults to WARN and prints "No existing dataset at ... it will be created" on the
# first write of every table; read once when lance is imported. A LANCE_LOG the user set wins.
os.environ.setdefault("LANCE_LOG", "error")

import lance  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from lance.commit import CommitConflictError  # noqa: E402

from diffrl.engines.store import commits, fs  # noqa: E402

_APPEND_ATTEMPTS = 8


class DamagedStore(RuntimeError):
    """A table of the run is missing, lost committed rows, or holds values that are not the ones written."""


def sql_str(value: str) -> str:
    """A SQL string literal (single quotes doubled) for Lance filters."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values: list[Any]) -> str:
    """`column IN (...)` for ints or strings; FALSE for an empty list."""
    if not values:
        return "FALSE"
    items = ", ".join(sql_str(v) if isinstance(v, str) else str(int(v)) for v in values)
    return f"{column} IN ({items})"


def sibling_uri(uri: str, name: str) -> str:
    """`<dir>/<name>.lance` next to `uri` (`<dir>/<stem>_<name>.lance` unless the stem is
    `trajectories`, so two stores in one directory never share sibling tables)."""
    stem = fs.basename(uri).removesuffix(".lance")
    file = f"{name}.lance" if stem == "trajectories" else f"{stem}_{name}.lance"
    return fs.join(fs.parent(uri), file)


# Lance keeps the manifests and file metadata of every version a handle has read in its session's metadata cache,
# which only its size bounds (by default far above what a table needs): a run commits to its tables every step, and
# a handle's cache grew to 105 MB over 400 appends to one table (4 MB with this bound, its process's memory flat).
METADATA_CACHE_BYTES = 16 << 20


def new_write_id() -> str:
    """A unique id stamped on every row of one append (identifies the write for dedupe)."""
    return uuid.uuid4().hex


class LanceTable:
    """A lazily created Lance table at `uri` (local path or s3:// / gs:// / memory:// URI).

    Every use of the handle holds a lock: a LanceDataset is not safe to share between threads (the
    reward stage reads a chunk while the rollout appends the next: "Already borrowed"), and one
    handle must be kept (memory:// tables). Rows are encoded before the lock is taken.
    """

    def __init__(self, uri: str, *, storage_options: dict | None = None):
        self.uri = str(uri)
        self.storage_options = dict(storage_options or {})
        self._ds: lance.LanceDataset | None = None
        self._lock = threading.RLock()
        self._session = lance.Session(metadata_cache_size_bytes=METADATA_CACHE_BYTES)  # every handle of this table

    def dataset(self) -> lance.LanceDataset | None:
        """The latest committed version, or None when nothing was ever committed here.

        An existing but unreadable table raises ValueError naming the path.
        """
        with self._lock:
            if self._ds is not None:
                self._ds.checkout_latest()
                return self._ds
            try:
                self._ds = self._open()
            except ValueError as e:
                # Lance reports a missing table (no _versions manifest) as "... was not found".
                if "was not found" in str(e) or "Not found" in str(e):
                    return None
                raise ValueError(f"{self.uri}: cannot read the Lance table (corrupt or not a Lance table): {e}") from e
            except OSError as e:
                raise ValueError(f"{self.uri}: cannot read the Lance table: {e}") from e
            return self._ds

    def version(self) -> int:
        """The latest committed version (0 before the first write)."""
        with self._lock:
            ds = self.dataset()
            return 0 if ds is None else ds.version

    def schema_metadata(self) -> dict[str, str]:
        """The table's schema metadata as str -> str ({} before the first write)."""
        with self._lock:
            ds = self.dataset()
            if ds is None:
                return {}
            meta = ds.schema.metadata or {}
            return {k.decode(): v.decode() for k, v in meta.items()}

    def append(self, table: pa.Table) -> None:
        """Append rows as one commit: all rows become visible together or none do.

        Lance commits are optimistic; concurrent appends rebase on each other inside Lance, and
        a conflict that still surfaces (e.g. two processes creating the table) is retried here.
        Under a commit lock (diffrl/engines/store/commits.py) the rows are written first and only the
        commit holds the lock.
        """
        lock = commits.lock_for(self.uri)
        if lock is not None:
            return self._append_under(lock, table)
        with self._lock:
            for attempt in range(_APPEND_ATTEMPTS):
                target = self.dataset()
                try:
                    if target is None and self._create_atomically(table):
                        return
                    if target is not None or not self._is_local():
                        self._ds = lance.write_dataset(
                            table,
                            target if target is not None else self.uri,
                            mode="append",
                            storage_options=self.storage_options or None,
                            session=self._session,
                        )
                        return
                except CommitConflictError:
                    pass
                except OSError as e:
                    # another process created the table first (object stores): append to it
                    if target is not None or "already exists" not in str(e):
                        raise
                if attempt == _APPEND_ATTEMPTS - 1:
                    raise CommitConflictError(f"{self.uri}: append still conflicting after {_APPEND_ATTEMPTS} attempts")
                time.sleep(0.05 * (attempt + 1))

    def _append_under(self, lock: commits.CommitLock, table: pa.Table) -> None:
        """Append with the commit serialised by `lock`. The first write creates the table holding the lock; after it,
        the data files go up at once and only the manifest's commit holds the lock (no other writer commits
        meanwhile, so Lance rebases this append onto whatever was committed since the files were written)."""
        with self._lock:
            if self.dataset() is None:
                with lock.hold(self.uri):
                    if self.dataset() is None:
                        self._ds = lance.write_dataset(
                            table,
                            self.uri,
                            mode="create",
                            storage_options=self.storage_options or None,
                            session=self._session,
                        )
                        return
            transaction = lance.fragment.write_fragments(
                table, self._ds, return_transaction=True, storage_options=self.storage_options or None
            )
            with lock.hold(self.uri):
                lance.LanceDataset.commit(self.uri, transaction, storage_options=self.storage_options or None)
            self._ds = self._open()  # commit() takes no session: this table's bounded one

    def _open(self) -> lance.LanceDataset:
        return lance.dataset(self.uri, storage_options=self.storage_options or None, session=self._session)

    def _serialised(self):
        """The commit lock of this table (held around a delete, compaction or clean-up), or no lock."""
        lock = commits.lock_for(self.uri)
        return contextlib.nullcontext() if lock is None else lock.hold(self.uri)

    def _is_local(self) -> bool:
        return fs._split_scheme(self.uri)[0] in ("", "file://")

    def _create_atomically(self, table: pa.Table) -> bool:
        """Create a local table with its first rows, or return False if another process created it.

        Lance's own create on a local path is not atomic against another process creating the same
        table: in two-process races the loser failed with "Dataset already exists" (15 of 15), and a
        commit can also be replaced with no error on either side (seen once in the test suite, and in
        2 of 15 races of a first fix that checked after the fact). So the table is written beside its path and
        renamed into place; the rename fails when the path already holds a table, and the caller
        appends to that one instead. Object stores keep Lance's own create (conditional writes).
        """
        if not self._is_local():
            return False
        path = fs._split_scheme(self.uri)[1]
        staging = f"{path}.creating-{uuid.uuid4().hex}"
        lance.write_dataset(table, staging, mode="create")
        try:
            os.rename(staging, path)  # atomic; refuses a non-empty target
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            return False
        self._ds = self._open()
        return True

    def scan(
        self, columns: list[str], filter: str | None = None, *, row_address: bool = False, blobs_as_bytes: bool = False
    ) -> pa.Table | None:
        """Rows in table order (insertion order, kept by compaction); None when no table yet. Lance chooses
        late materialization itself (forcing it off read whole compacted fragments for a few rows)."""
        with self._lock:
            ds = self.dataset()
            if ds is None:
                return None
            scanner = ds.scanner(
                columns=columns,
                filter=filter,
                scan_in_order=True,
                with_row_address=row_address or None,
                blob_handling="all_binary" if blobs_as_bytes else None,
            )
            try:
                return scanner.to_table()
            except (OSError, ValueError) as e:  # Lance: "External error: Encountered corrupt file ..."
                if "corrupt" not in str(e).lower():
                    raise
                raise DamagedStore(f"{self.uri} holds a damaged data file ({str(e).splitlines()[0][:300]})") from e

    def delete(self, predicate: str) -> None:
        """Delete rows (Lance retries conflicts itself)."""
        with self._lock, self._serialised():
            ds = self.dataset()
            if ds is not None:
                ds.delete(predicate)

    def compact(
        self, *, target_rows_per_fragment: int | None = None, excluded_fragment_ids: list[int] | None = None
    ) -> None:
        """Merge small adjacent fragments (one per append) and drop deleted rows physically."""
        with self._lock, self._serialised():
            ds = self.dataset()
            if ds is None:
                return
            if len(ds.get_fragments()) > 1 or _has_deletions(ds):
                ds.optimize.compact_files(
                    target_rows_per_fragment=target_rows_per_fragment,
                    materialize_deletions_threshold=0.0,
                    excluded_fragment_ids=excluded_fragment_ids or None,
                )

    def cleanup(self, older_than_seconds: float, *, delete_unverified: bool = False) -> int:
        """Remove versions older than `older_than_seconds` and their unreferenced files; bytes freed."""
        with self._lock, self._serialised():
            ds = self.dataset()
            if ds is None:
                return 0
            stats = ds.cleanup_old_versions(
                older_than=timedelta(seconds=older_than_seconds), delete_unverified=delete_unverified
            )
            return int(stats.bytes_removed)


def _has_deletions(ds: lance.LanceDataset) -> bool:
    return any(f.deletion_file() is not None for f in ds.get_fragments())


def first_writes(table: pa.Table, unit_columns: list[str]) -> pa.Table:
    """Keep only the rows of the write committed first for each unit (e.g. (step, chunk)).

    `table` is a scan in table order with a `write_id` column, and every write covers exactly
    one unit. When two processes race to write the same unit both commits land; every reader
    keeps the earlier one (first in table order), so all readers agree, and the later writer
    can tell that it lost (check-after-commit) and delete its rows.
    """
    if table.num_rows == 0:
        return table
    firsts = _first_positions(table, unit_columns)
    winners = pc.take(table.column("write_id"), firsts)
    return table.filter(pc.is_in(table.column("write_id"), value_set=winners))


def first_rows(table: pa.Table, key_columns: list[str]) -> pa.Table:
    """Keep the first row (in table order) of each key; result in table order."""
    if table.num_rows == 0:
        return table
    firsts = _first_positions(table, key_columns)
    return table.take(pc.take(firsts, pc.sort_indices(firsts)))


def _first_positions(table: pa.Table, key_columns: list[str]) -> pa.Array:
    pos = pa.array(np.arange(table.num_rows, dtype=np.int64))
    indexed = table.select(key_columns).append_column("_pos", pos)
    firsts = indexed.group_by(key_columns, use_threads=False).aggregate([("_pos", "min")])
    return firsts.column("_pos_min").combine_chunks()
