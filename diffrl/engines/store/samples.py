"""Per-sample value tables (rewards, advantages) next to the trajectory table.

Keyed by sample: (step, group_id, sample_index). Append-only: a write is a few KB, never touches
the latents, and the first committed value of a key wins (re-writes are no-ops), exactly like the
trajectory chunks. Reads join on the key in Arrow, so they align with any order the caller asks.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from diffrl.engines.store.tables import LanceTable, first_rows, new_write_id

SAMPLE_KEY = ["group_id", "sample_index"]


def key_table(group_ids: list[str], sample_index: np.ndarray) -> pa.Table:
    """A (group_id, sample_index) table; duplicates are a ValueError."""
    keys = pa.table(
        {
            "group_id": pa.array([str(g) for g in group_ids], pa.string()),
            "sample_index": pa.array(np.asarray(sample_index, dtype=np.int64)),
        }
    )
    if keys.group_by(SAMPLE_KEY).aggregate([]).num_rows != keys.num_rows:
        raise ValueError("keys: (group_id, sample_index) pairs must be unique within one write")
    return keys


class SampleTable:
    """One append-only Lance table of values keyed by (step, group_id, sample_index)."""

    def __init__(self, uri: str, value_fields: list[pa.Field], *, storage_options: dict | None = None):
        self.table = LanceTable(uri, storage_options=storage_options)
        self.value_fields = value_fields
        self.schema = pa.schema(
            [
                pa.field("step", pa.int64()),
                pa.field("group_id", pa.string()),
                pa.field("sample_index", pa.int64()),
                *value_fields,
                pa.field("write_id", pa.string()),
            ]
        )

    def _stored(self, step: int, columns: list[str]) -> pa.Table:
        """Deduplicated rows of one step (first committed value per key), in table order."""
        rows = self.table.scan(
            SAMPLE_KEY + [c for c in columns if c not in SAMPLE_KEY] + ["write_id"], filter=f"step = {int(step)}"
        )
        if rows is None:
            return self.schema.empty_table().select(SAMPLE_KEY + columns)
        return first_rows(rows, SAMPLE_KEY)

    def append(self, step: int, keys: pa.Table, values: dict[str, pa.Array]) -> int:
        """Write values for keys not yet stored at `step`; returns how many rows were written."""
        # Acero joins cannot carry list columns, so join positions only and take the values after.
        positions = keys.select(SAMPLE_KEY).append_column("_pos", pa.array(np.arange(keys.num_rows, dtype=np.int64)))
        fresh = positions.join(self._stored(step, []).select(SAMPLE_KEY), keys=SAMPLE_KEY, join_type="left anti")
        if fresh.num_rows == 0:
            return 0
        take = pc.sort_indices(fresh.column("_pos"))
        index = pc.take(fresh.column("_pos"), take)
        n = len(index)
        columns = {
            "step": pa.array(np.full(n, int(step), np.int64)),
            "group_id": pc.take(keys.column("group_id"), index),
            "sample_index": pc.take(keys.column("sample_index"), index),
            **{f.name: pc.take(values[f.name], index) for f in self.value_fields},
            "write_id": pa.array([new_write_id()] * n, pa.string()),
        }
        self.table.append(pa.Table.from_pydict(columns, schema=self.schema))
        return n

    def read(self, step: int, keys: pa.Table, columns: list[str]) -> tuple[pa.Table, np.ndarray]:
        """Values for `keys` in their order, and a bool mask of the keys that have a stored value."""
        ordered = keys.select(SAMPLE_KEY).append_column("_pos", pa.array(np.arange(keys.num_rows, dtype=np.int64)))
        stored = self._stored(step, columns)
        spos = stored.select(SAMPLE_KEY).append_column("_spos", pa.array(np.arange(stored.num_rows, dtype=np.int64)))
        joined = ordered.join(spos, keys=SAMPLE_KEY, join_type="left outer").sort_by("_pos")
        index = joined.column("_spos").combine_chunks()
        found = index.is_valid().to_numpy(zero_copy_only=False)
        return stored.select(columns).take(index), found

    def steps(self) -> list[int]:
        rows = self.table.scan(["step"])
        return [] if rows is None else sorted(set(pc.unique(rows.column("step")).to_pylist()))
