"""What a run committed to its tables, checked before a resume trusts them (as checksums.json is for a checkpoint).

Two records, each a few bytes per step:
  stored_rows.json   in every checkpoint folder: the samples of each step up to the checkpoint's, which each of
                     trajectories.lance, rewards.lance and advantages.lance must hold (written with the checkpoint,
                     which commits after the step's rows, rewards and advantages on every replica)
  <column>_digest    in every row of trajectories.lance: a digest of the row's latents and of its log-probs, committed
                     with the row (diffrl/engines/store/records.py)
A resume (`check_stored`) compares the loaded checkpoint's record with the tables' rows per step, and the digests of
the steps it trains again (the checkpoint's are not trained on again) with their latents and log-probs. A table that
is missing or holds fewer rows of a step (deleted, lost files, its newest manifest gone: Lance then reads the version
before) or a value that differs from its digest is a DamagedStore naming the table, the step and the column: no rerun
repairs it, and the run never trains on top of it.
"""

from __future__ import annotations

from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from diffrl.engines.numbering import step_number
from diffrl.engines.store import fs
from diffrl.engines.store.records import DIGESTED, digest_column, first_altered
from diffrl.engines.store.tables import DamagedStore, first_writes

RECORD = "stored_rows.json"


def write_record(folder: str, previous: str | None, step: int, samples: int) -> None:
    """Write `folder`/stored_rows.json: the record of checkpoint folder `previous` (when it has one) and step index
    `step` with its `samples` samples."""
    rows = {}
    if previous is not None and fs.exists(fs.join(previous, RECORD)):
        rows = read_record(previous)
    rows[step_number(step)] = int(samples)
    rows = {k: v for k, v in rows.items() if k <= step_number(step)}  # a step trained again replaces what followed
    fs.write_json(fs.join(folder, RECORD), {"rows": {str(k): v for k, v in sorted(rows.items())}})


def read_record(checkpoint: str) -> dict[int, int]:
    """{step number: samples} that checkpoint folder `checkpoint` records ({} for one written without a record)."""
    path = fs.join(checkpoint, RECORD)
    if not fs.exists(path):
        return {}
    try:
        return {int(k): int(v) for k, v in fs.read_json(path)["rows"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedStore(f"{path} is not the record diffrl wrote ({e})") from None


def rows_per_step(store: Any) -> dict[str, dict[int, int] | None]:
    """Per table of `store` (trajectories, rewards, advantages; by URI): its committed samples per step number,
    duplicates of raced writes excluded; None for a table that does not exist."""
    trajectories, *samples = store.tables()
    rows = trajectories.scan(["step", "chunk", "write_id"])
    counts = {trajectories.uri: None if rows is None else _per_step(first_writes(rows, ["step", "chunk"]))}
    for table in samples:
        rows = table.scan(["step", "group_id", "sample_index"])
        keys = None if rows is None else rows.group_by(["step", "group_id", "sample_index"]).aggregate([])
        counts[table.uri] = None if keys is None else _per_step(keys)
    return counts


def _per_step(rows: pa.Table) -> dict[int, int]:
    """{step number: rows} of a table with a `step` column."""
    return {int(c["values"]): int(c["counts"]) for c in pc.value_counts(rows.column("step")).to_pylist()}


def check_digests(store: Any, step: int) -> None:
    """DamagedStore naming the column and a sample of step index `step` whose latents or log-probs differ from the
    digests written with its row (rows without latents, dropped by retention, have only their log-probs checked; a
    table written before rows carried digests, nothing)."""
    table = store.tables()[0]
    stored = set(table.dataset().schema.names)
    names = [name for name in DIGESTED if digest_column(name) in stored]
    if not names:
        return
    columns = ["chunk", "group_id", "sample_index", "write_id", *names, *map(digest_column, names)]
    rows = first_writes(table.scan(columns, filter=f"step = {step_number(step)}"), ["chunk"])
    for name in names:
        altered = first_altered(rows, name)
        if altered is not None:
            raise DamagedStore(
                f"{table.uri}: the {name} of step {step_number(step)} sample (group_id={altered[0]!r}, "
                f"sample_index={altered[1]}) differ from the digest written with them ({digest_column(name)}): the "
                "stored data changed after it was written"
            )


def check_stored(store: Any, checkpoint: str | None, resumed: Iterable[int]) -> None:
    """DamagedStore unless every table holds the rows `checkpoint` records (None: a run without one), the rewards and
    advantages of each step index in `resumed` have rows in trajectories.lance, and their latents and log-probs match
    their digests."""
    record = {} if checkpoint is None else read_record(checkpoint)
    counts = rows_per_step(store)
    for uri, held in counts.items():
        for number, want in sorted(record.items()):
            have = None if held is None else held.get(number, 0)
            if have is None:
                raise DamagedStore(
                    f"{uri} is missing, yet checkpoint {checkpoint} records {want} rows of step {number} in it"
                )
            if have < want:
                raise DamagedStore(
                    f"{uri} holds {have} rows of step {number} where checkpoint {checkpoint} records {want}: committed "
                    "rows were lost (deleted files, or the table rolled back to an older version)"
                )
    [trajectories, *samples] = counts.items()
    for step in resumed:
        number = step_number(step)
        written = (trajectories[1] or {}).get(number, 0)
        for uri, held in samples:
            if (held or {}).get(number, 0) > written:
                raise DamagedStore(
                    f"{trajectories[0]} holds {written} rows of step {number} where {uri} holds {held[number]}: rows "
                    "of it were lost (deleted files, or the table rolled back to an older version)"
                )
        if written:
            check_digests(store, step)
