"""The trajectory store: one Lance table of samples per run, plus per-sample reward/advantage tables.

Layout under `runs/<run>/` (any fsspec/Lance URI):
  trajectories.lance  one row per sample (records.py has the columns), appended one (step, chunk)
                      per commit, so a crash mid-write leaves no partial chunk visible
  rewards.lance       (step, group_id, sample_index) -> reward, valid, components
  advantages.lance    (step, group_id, sample_index) -> advantage
Rewards and advantages live in sibling tables instead of merged columns because they arrive chunk
by chunk after the rows are written; merging a column into Lance rows rewrites those rows, latents
included (~0.8 MB per Qwen-Image sample), while a sibling append is a few KB (docs/concepts.md).

Steps: the methods take the code's step index (0, 1, ...), as the engines count; the tables' `step` column holds
the step number a person sees (index + 1: diffrl/engines/numbering.py), so plain readers of the tables, the console
and MLflow agree. `steps()` answers in indices.

Idempotency and races: `append` is a no-op when its (step, chunk) is already committed. Two
processes that race on the same chunk both commit; readers keep only the write that comes first
in table order (Lance appends in commit order and compaction keeps it), and the losing writer
sees that right after its commit, deletes its rows and returns False.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from PIL import Image

from diffrl.engines.numbering import step_index, step_number
from diffrl.engines.store.records import (
    AUDIO_COLUMNS,
    KEY_COLUMNS,
    META_LATENT_DTYPE,
    META_LATENT_SHAPE,
    META_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SMALL_COLUMNS,
    decode_image,
    from_arrow,
    to_arrow,
)
from diffrl.engines.store.samples import SampleTable, key_table
from diffrl.engines.store.tables import LanceTable, first_writes, new_write_id, sibling_uri, sql_in, sql_str
from diffrl.engines.trajectories import Trajectories

# `prompt` (the sample's, as in trajectories.lance) and `excluded` (True: the sample is not trained on; its reward is
# NaN and valid False, its advantage NaN) make either table readable alone (docs/concepts.md, "Reading a run")
REWARD_FIELDS = [
    pa.field("prompt", pa.string()),
    pa.field("reward", pa.float32()),
    pa.field("valid", pa.bool_()),
    pa.field("excluded", pa.bool_()),
    pa.field("component_names", pa.list_(pa.string())),
    pa.field("component_values", pa.list_(pa.float32())),
]
ADVANTAGE_FIELDS = [
    pa.field("prompt", pa.string()),
    pa.field("advantage", pa.float32()),
    pa.field("excluded", pa.bool_()),
]
SampleKeys = Trajectories | Sequence[tuple[str, int]] | Sequence[tuple[int, str, int]]


class TrajectoryStore:
    """Trajectories of one run in Lance tables at `uri` (".../runs/<run>/trajectories.lance")."""

    def __init__(self, uri: str, *, storage_options: dict | None = None, png_compress_level: int = 1):
        self.uri = str(uri)
        self.png_compress_level = png_compress_level
        self._table = LanceTable(self.uri, storage_options=storage_options)
        self._keys_memo: dict[tuple[int, int], pa.Table] = {}
        self._rewards = SampleTable(sibling_uri(self.uri, "rewards"), REWARD_FIELDS, storage_options=storage_options)
        self._advantages = SampleTable(
            sibling_uri(self.uri, "advantages"), ADVANTAGE_FIELDS, storage_options=storage_options
        )
        self._table.dataset()  # a corrupt table fails here, naming its path

    # ----------------------------------------------------------------------------- layout
    def latent_shape(self) -> tuple[int, ...] | None:
        """(W + 1, *S) of the stored latents; None before the first write."""
        meta = self._table.schema_metadata()
        if not meta:
            return None
        if meta.get(META_SCHEMA_VERSION) != SCHEMA_VERSION:
            raise ValueError(
                f"{self.uri}: table has schema version {meta.get(META_SCHEMA_VERSION)!r}; "
                f"this code reads version {SCHEMA_VERSION!r}"
            )
        return tuple(json.loads(meta[META_LATENT_SHAPE]))

    def has_audio(self) -> bool:
        """Whether the table has the audio columns (a model that makes audio wrote it)."""
        dataset = self._table.dataset()
        return dataset is not None and "audio" in dataset.schema.names

    def _check_layout(self, traj: Trajectories, step: int, chunk: int) -> None:
        new_shape, new_dtype = tuple(traj.latents.shape[1:]), str(traj.latents.dtype).removeprefix("torch.")
        stored_shape = self.latent_shape()
        stored_dtype = self._table.schema_metadata().get(META_LATENT_DTYPE, "float32")
        if stored_shape is None and new_dtype == "float32":
            return
        stored_audio = stored_shape is not None and self.has_audio()  # one read of the latest version's schema
        if stored_shape is not None and stored_audio != (traj.audio is not None):
            held, given = ("audio", "no audio") if stored_audio else ("no audio", "audio")
            raise ValueError(
                f"{self.uri}: table stores samples with {held}; the write of step {step} chunk {chunk} has {given}. "
                "Nothing was written."
            )
        if (stored_shape, stored_dtype) != (new_shape, new_dtype):
            stored = "float32 latents (first write)" if stored_shape is None else f"{stored_dtype} {stored_shape}"
            raise ValueError(
                f"{self.uri}: table stores latents {stored}; the write of step {step} chunk {chunk} "
                f"has {new_dtype} {new_shape}. Nothing was written."
            )

    # ----------------------------------------------------------------------------- keys
    def _step_keys(self, step: int, extra: Sequence[str] = ()) -> pa.Table:
        """Committed rows of `step` (first write per chunk), key columns only, in table order.

        Memoised per (step, table version): every stage reads the step's keys, and any commit (ours
        or another process's) makes a new version, so a memoised answer is never stale."""
        if extra:
            return self._scan_step_keys(step, extra)
        key = (int(step), self._table.version())
        if key not in self._keys_memo:
            self._keys_memo = {key: self._scan_step_keys(step, ())}  # keep only the latest
        return self._keys_memo[key]

    def _scan_step_keys(self, step: int, extra: Sequence[str]) -> pa.Table:
        rows = self._table.scan(KEY_COLUMNS + list(extra), filter=f"step = {step_number(step)}")
        if rows is None:
            return pa.table(
                {
                    c: pa.array([], t)
                    for c, t in [
                        ("chunk", pa.int64()),
                        ("chunk_row", pa.int64()),
                        ("group_id", pa.string()),
                        ("sample_index", pa.int64()),
                        ("write_id", pa.string()),
                    ]
                }
            )
        return first_writes(rows, ["chunk"])

    def _shard(self, step: int, rank: int, world_size: int) -> pa.Table:
        """Keys of rank's contiguous shard of `step`, ordered by (chunk, row)."""
        keys = self._step_keys(step)
        n = keys.num_rows
        if n == 0:
            raise ValueError(f"{self.uri}: step {step} has no committed rows (stored steps: {self.steps()})")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"read: rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        if n % world_size:
            raise ValueError(f"{self.uri}: step {step} has {n} rows, not divisible by world_size={world_size}")
        per = n // world_size
        ordered = keys.sort_by([("chunk", "ascending"), ("chunk_row", "ascending")])
        return ordered.slice(rank * per, per)

    def has_chunk(self, step: int, chunk: int) -> bool:
        """Whether (step, chunk) is committed."""
        return self.chunk_rows(step, chunk) > 0

    def chunk_rows(self, step: int, chunk: int) -> int:
        """Committed samples of (step, chunk); 0 when it is not committed."""
        keys = self._step_keys(step)
        return int(pc.sum(pc.equal(keys.column("chunk"), chunk)).as_py() or 0)

    def committed_chunks(self, step: int) -> set[int]:
        """Chunks of `step` that are committed."""
        return set(pc.unique(self._step_keys(step).column("chunk")).to_pylist())

    # ----------------------------------------------------------------------------- write
    def append(self, traj: Trajectories, *, run: str, step: int, chunk: int) -> bool:
        """Commit one chunk of samples; False (and nothing written) if (step, chunk) is committed.

        All rows of the chunk become visible in one Lance commit. A different latent shape or dtype
        than the table's, or a sample key already stored in another chunk of the step, is a
        ValueError raised before anything is written.
        """
        if len(traj) == 0:
            raise ValueError(f"{self.uri}: append of step {step} chunk {chunk} has no samples")
        self._check_layout(traj, step, chunk)
        keys = self._step_keys(step)
        if chunk in set(pc.unique(keys.column("chunk")).to_pylist()):
            return False
        incoming = key_table(traj.group_ids, traj.sample_index.numpy())
        clash = incoming.join(
            keys.select(["group_id", "sample_index", "chunk"]), keys=["group_id", "sample_index"], join_type="inner"
        )
        if clash.num_rows:
            g, i, c = (clash.column(k)[0].as_py() for k in ("group_id", "sample_index", "chunk"))
            raise ValueError(
                f"{self.uri}: sample (step={step}, group_id={g!r}, sample_index={i}) of chunk "
                f"{chunk} is already stored in chunk {c}. Nothing was written."
            )
        write_id = new_write_id()
        self._table.append(self._fit(self._rows(traj, run=run, step=step, chunk=chunk, write_id=write_id)))
        # Check after commit: if a racing writer committed this chunk first, readers ignore our
        # rows already; delete them so they do not take space.
        committed = self._step_keys(step)
        winner = committed.filter(pc.equal(committed.column("chunk"), chunk))
        if winner.num_rows and winner.column("write_id")[0].as_py() != write_id:
            self._table.delete(f"write_id = {sql_str(write_id)}")
            return False
        return True

    def _fit(self, rows: pa.Table) -> pa.Table:
        """`rows` without the digest columns when the table was created before rows carried them (Lance appends
        rows of the table's own schema only); such a table's rows are not checked against digests."""
        dataset = self._table.dataset()
        if dataset is None:
            return rows
        missing = [c for c in rows.column_names if c.endswith("_digest") and c not in dataset.schema.names]
        return rows.drop_columns(missing) if missing else rows

    def _rows(self, traj: Trajectories, *, run: str, step: int, chunk: int, write_id: str) -> pa.Table:
        """One chunk's samples as the table's Arrow rows (a token store's rows: diffrl/engines/store/tokens.py)."""
        return to_arrow(
            traj,
            run=run,
            step=step_number(step),
            chunk=chunk,
            write_id=write_id,
            compress_level=self.png_compress_level,
        )

    # ----------------------------------------------------------------------------- read
    def read_step(
        self, step: int, *, rank: int = 0, world_size: int = 1, with_latents: bool = True, with_images: bool = True
    ) -> Trajectories:
        """The samples of `step` ordered by (chunk, row); rank r of N gets the r-th contiguous
        1/N of them (whole groups stay together when the group size divides the shard).

        with_latents=False / with_images=False skip reading those columns and return zero-size
        placeholders: latents (B, W + 1, 0), images (B, 0, 0, 3).
        """
        shard = self._shard(step, rank, world_size)
        where = ""
        if world_size > 1:
            (c0, r0), (c1, r1) = [
                (shard.column("chunk")[i].as_py(), shard.column("chunk_row")[i].as_py())
                for i in (0, shard.num_rows - 1)
            ]
            where = (
                f" AND (chunk > {c0} OR (chunk = {c0} AND chunk_row >= {r0}))"
                f" AND (chunk < {c1} OR (chunk = {c1} AND chunk_row <= {r1}))"
            )
        return self._read_rows(step, shard, where, with_latents=with_latents, with_images=with_images)

    def read_chunk(self, step: int, chunk: int, *, with_latents: bool = True, with_images: bool = True) -> Trajectories:
        """The samples of one committed chunk in row order (what the reward stage scores)."""
        keys = self._step_keys(step)
        rows = keys.filter(pc.equal(keys.column("chunk"), chunk))
        if rows.num_rows == 0:
            raise ValueError(
                f"{self.uri}: step {step} chunk {chunk} is not committed "
                f"(committed chunks: {sorted(self.committed_chunks(step))})"
            )
        return self._read_rows(
            step, rows, f" AND chunk = {int(chunk)}", with_latents=with_latents, with_images=with_images
        )

    def _read_rows(
        self, step: int, keys: pa.Table, where_extra: str, *, with_latents: bool, with_images: bool
    ) -> Trajectories:
        """Scan the committed rows `keys` of `step` (narrowed by `where_extra`) into Trajectories."""
        latent_shape = self.latent_shape()
        winners = pc.unique(keys.column("write_id")).to_pylist()
        where = f"step = {step_number(step)} AND {sql_in('write_id', winners)}" + where_extra
        columns = SMALL_COLUMNS + ["latents"] * with_latents + ["image"] * with_images
        if with_images and self.has_audio():
            columns += AUDIO_COLUMNS
        # Lance's own choice of late materialization: reading every column in one pass read whole compacted
        # fragments (0.37 s against 0.014 s for one step of shapes_quick; benchmarks/store_io.py: 2.15 s
        # against 1.43 s for a 400 MB step)
        data = self._table.scan(columns, filter=where, blobs_as_bytes=with_images)
        if data.num_rows != keys.num_rows:
            raise ValueError(
                f"{self.uri}: step {step} changed while being read ({data.num_rows} rows, "
                f"expected {keys.num_rows}); retry the read"
            )
        if with_latents and not pc.all(data.column("has_latents")).as_py():
            raise ValueError(
                f"{self.uri}: latents of step {step} were dropped by retention "
                "(drop_latents / keep_latents_steps); read it with with_latents=False"
            )
        order = pc.sort_indices(data, sort_keys=[("chunk", "ascending"), ("chunk_row", "ascending")]).to_numpy()
        return from_arrow(data, order, latent_shape, with_latents=with_latents, with_images=with_images)

    def image(self, step: int, group_id: str, sample_index: int) -> Image.Image:
        """The stored image of one sample (a video comes back as its vertical filmstrip)."""
        rows = self._table.scan(
            ["group_id", "sample_index", "write_id", "image"],
            blobs_as_bytes=True,
            filter=f"step = {step_number(step)} AND group_id = {sql_str(group_id)} "
            f"AND sample_index = {int(sample_index)}",
        )
        if rows is None or rows.num_rows == 0:
            raise ValueError(f"{self.uri}: no sample (step={step}, group_id={group_id!r}, sample_index={sample_index})")
        return decode_image(rows.column("image")[0].as_py())  # first in table order = the committed write

    def image_bytes(self, step: int) -> float | None:
        """Mean stored bytes of one sample's decoded output of step `step`'s rows, as written: its image or video
        (PNG) and its audio (WAV) where the model makes audio; None when the step has no rows."""
        columns = ["image"] + ["audio"] * self.has_audio()
        rows = self._table.scan(columns, filter=f"step = {step_number(step)}")  # blob descriptors, not the bytes
        if rows is None or rows.num_rows == 0:
            return None
        sizes = [pc.fill_null(rows.column(c).combine_chunks().field("size"), 0) for c in columns]  # null: no image
        return float(pc.mean(sizes[0] if len(sizes) == 1 else pc.add(*sizes)).as_py())

    def steps(self) -> list[int]:
        """Steps (indices) with at least one committed row, ascending."""
        rows = self._table.scan(["step"])
        return [] if rows is None else [step_index(s) for s in sorted(pc.unique(rows.column("step")).to_pylist())]

    def num_rows(self, step: int | None = None) -> int:
        """Committed samples of `step` (or of all steps), duplicates of raced writes excluded."""
        if step is not None:
            return self._step_keys(step).num_rows
        rows = self._table.scan(["step", "chunk", "write_id"])
        return 0 if rows is None else first_writes(rows, ["step", "chunk"]).num_rows

    def version(self) -> int:
        """Latest version of the trajectory table (0 before the first write)."""
        return self._table.version()

    def tables(self) -> tuple[LanceTable, LanceTable, LanceTable]:
        """The handles of the trajectory, reward and advantage tables (diffrl/engines/store/integrity.py reads them)."""
        return self._table, self._rewards.table, self._advantages.table

    # ----------------------------------------------------------------------------- rewards
    def _keys(self, step: int, keys: SampleKeys) -> pa.Table:
        """Normalise the accepted key forms to a (group_id, sample_index) table."""
        if isinstance(keys, Trajectories):
            return key_table(keys.group_ids, keys.sample_index.numpy())
        keys = list(keys)
        if keys and len(keys[0]) == 3:
            bad = sorted({int(k[0]) for k in keys} - {int(step)})
            if bad:
                raise ValueError(f"keys: (step, group_id, sample_index) triples name steps {bad}, not step {step}")
            keys = [(k[1], k[2]) for k in keys]
        if any(len(k) != 2 for k in keys):
            raise ValueError(
                "keys: expected Trajectories, (group_id, sample_index) pairs or (step, group_id, sample_index) triples"
            )
        return key_table([k[0] for k in keys], np.array([int(k[1]) for k in keys], dtype=np.int64))

    def _prompts(self, step: int, keys: SampleKeys, table: pa.Table) -> pa.Array:
        """The prompts of the samples `table` names (the trajectories' own when `keys` is one; else looked up in the
        step's rows), for the prompt column of the reward and advantage tables."""
        if isinstance(keys, Trajectories):
            return pa.array(keys.prompts, pa.string())
        stored = self._step_keys(step, ["prompt"]).select(["group_id", "sample_index", "prompt"])
        positions = table.append_column("_pos", pa.array(np.arange(table.num_rows, dtype=np.int64)))
        joined = positions.join(stored, keys=["group_id", "sample_index"], join_type="left outer").sort_by("_pos")
        return joined.column("prompt").combine_chunks()

    def _check_known(self, step: int, keys: pa.Table, what: str) -> None:
        unknown = keys.join(
            self._step_keys(step).select(["group_id", "sample_index"]),
            keys=["group_id", "sample_index"],
            join_type="left anti",
        )
        if unknown.num_rows:
            g, i = unknown.column("group_id")[0].as_py(), unknown.column("sample_index")[0].as_py()
            raise ValueError(
                f"{self.uri}: {what} for {unknown.num_rows} samples not in step {step}, "
                f"e.g. (group_id={g!r}, sample_index={i}). Nothing was written."
            )

    def write_rewards(
        self,
        step: int,
        keys: SampleKeys,
        rewards: torch.Tensor,
        components: dict[str, torch.Tensor],
        valid: torch.Tensor,
    ) -> int:
        """Store rewards of samples of `step`; keys already rewarded are skipped (idempotent).

        rewards (n,), each component (n,), valid (n,) bool: an invalid sample (a reward function
        failed on it) is stored with valid=False and excluded downstream, never scored as 0.
        Returns the number of samples written.
        """
        table = self._keys(step, keys)
        n = table.num_rows
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).cpu()
        valid = torch.as_tensor(valid).reshape(-1).cpu()
        names = sorted(components)
        values = [torch.as_tensor(components[k], dtype=torch.float32).reshape(-1).cpu() for k in names]
        if rewards.shape != (n,) or valid.shape != (n,) or any(v.shape != (n,) for v in values):
            raise ValueError(f"write_rewards: rewards, valid and each component must have {n} values (one per key)")
        if valid.dtype != torch.bool:
            raise ValueError(f"write_rewards: valid must be a bool tensor, got {valid.dtype}")
        if not torch.isfinite(rewards[valid]).all():
            raise ValueError("write_rewards: a sample marked valid has a non-finite reward; mark it invalid")
        self._check_known(step, table, "rewards")
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * len(names))
        flat = torch.stack(values, 1).reshape(-1).numpy() if names else np.zeros(0, np.float32)
        columns = {
            "prompt": self._prompts(step, keys, table),
            "reward": pa.array(rewards.numpy()),
            "valid": pa.array(valid.numpy()),
            "excluded": pa.array(~valid.numpy()),
            "component_names": pa.ListArray.from_arrays(offsets, pa.array(names * n, pa.string())),
            "component_values": pa.ListArray.from_arrays(offsets, pa.array(flat, pa.float32())),
        }
        return self._rewards.append(step_number(step), table, columns)

    def read_rewards(
        self, step: int, *, rank: int = 0, world_size: int = 1, allow_missing: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """(rewards (n,), components {name: (n,)}, valid (n,)) aligned with read_step's order.

        A sample without a stored reward is a ValueError unless allow_missing, which gives it
        reward NaN and valid False. A component a sample lacks is NaN for it.
        """
        shard = self._shard(step, rank, world_size)
        values, found = self._rewards.read(step_number(step), shard, [f.name for f in REWARD_FIELDS])
        if not found.all() and not allow_missing:
            raise ValueError(
                f"{self._rewards.table.uri}: {int((~found).sum())} of {len(found)} samples of "
                f"step {step} have no reward yet (pass allow_missing=True to read the others)"
            )
        rewards = torch.from_numpy(pc.fill_null(values.column("reward"), float("nan")).to_numpy().copy())
        valid = torch.from_numpy(pc.fill_null(values.column("valid"), False).to_numpy(zero_copy_only=False).copy())
        return rewards, _components(values, len(found)), valid & torch.from_numpy(found)

    def write_advantages(self, step: int, keys: SampleKeys, advantages: torch.Tensor) -> int:
        """Store advantages of samples of `step`; keys already stored are skipped (idempotent)."""
        table = self._keys(step, keys)
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1).cpu()
        if adv.shape != (table.num_rows,):
            raise ValueError(f"write_advantages: expected {table.num_rows} advantages (one per key), got {adv.numel()}")
        self._check_known(step, table, "advantages")
        columns = {
            "prompt": self._prompts(step, keys, table),
            "advantage": pa.array(adv.numpy()),
            "excluded": pa.array(torch.isnan(adv).numpy()),  # excluded samples carry NaN: never a silent 0
        }
        return self._advantages.append(step_number(step), table, columns)

    def read_advantages(self, step: int, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """(n,) advantages aligned with read_step's order; a missing one is a ValueError."""
        shard = self._shard(step, rank, world_size)
        values, found = self._advantages.read(step_number(step), shard, ["advantage"])
        if not found.all():
            raise ValueError(
                f"{self._advantages.table.uri}: {int((~found).sum())} of {len(found)} samples of "
                f"step {step} have no advantage"
            )
        return torch.from_numpy(values.column("advantage").to_numpy().copy())

    # ----------------------------------------------------------------------------- retention
    def _delete_losers(self, where: str | None = None) -> None:
        """Physically delete rows of raced duplicate writes (readers already ignore them)."""
        rows = self._table.scan(["step", "chunk", "write_id"], filter=where)
        if rows is None or rows.num_rows == 0:
            return
        winners = set(pc.unique(first_writes(rows, ["step", "chunk"]).column("write_id")).to_pylist())
        losers = sorted(set(pc.unique(rows.column("write_id")).to_pylist()) - winners)
        if losers:
            self._table.delete(sql_in("write_id", losers))

    def drop_latents(self, keep_latents_steps: int, current_step: int) -> list[int]:
        """Null the latents of steps <= current_step - keep_latents_steps; returns those steps.

        Everything else of those rows (prompts, images, log-probs, ...) and the reward and
        advantage tables stay. The bytes are freed once compact() and cleanup() have run.
        """
        if keep_latents_steps < 0:
            raise ValueError(f"drop_latents: keep_latents_steps must be >= 0, got {keep_latents_steps}")
        where = f"has_latents AND step <= {step_number(current_step) - int(keep_latents_steps)}"
        rows = self._table.scan(["step"], filter=where)
        if rows is None or rows.num_rows == 0:
            return []
        steps = sorted(pc.unique(rows.column("step")).to_pylist())
        # Lance's update rewrites rows at the end of the table: settle raced duplicates first so
        # "first write in table order" cannot change.
        self._delete_losers(sql_in("step", steps))
        self._table.dataset().update({"latents": "NULL", "has_latents": "false"}, where=where)
        return [step_index(s) for s in steps]

    def _fragments(self, *, with_latents: bool) -> list[int]:
        """Ids of the fragments whose rows have (or, with_latents=False, lack) latents."""
        ds = self._table.dataset()
        frags = [] if ds is None else ds.get_fragments()
        return [f.fragment_id for f in frags if (f.count_rows("has_latents") > 0) == with_latents]

    def compact(self) -> None:
        """Merge the per-append fragments of all three tables and drop deleted rows physically."""
        self._delete_losers()
        shape = self.latent_shape()
        if shape is not None:
            # Aim at ~1 GiB fragments: whole-table compaction would rewrite every step's latents.
            row_bytes = 4 * int(np.prod(shape)) + 512 * 1024
            target = max(64, (1 << 30) // row_bytes)
            # Two passes, so no merged file mixes rows with and without latents: Lance stores the
            # null latents of a mixed page at full width, which would undo drop_latents.
            for keep_latents in (True, False):
                self._table.compact(
                    target_rows_per_fragment=target,
                    excluded_fragment_ids=self._fragments(with_latents=not keep_latents),
                )
        self._rewards.table.compact()
        self._advantages.table.compact()

    def cleanup(self, older_than_seconds: float = 3600.0, *, delete_unverified: bool = False) -> int:
        """Delete versions older than `older_than_seconds` (and files only they use); bytes freed.

        delete_unverified=True also removes files of writes that never committed (e.g. a killed
        append) younger than Lance's 7-day safety window; only use it when no writer is running.
        """
        return sum(
            t.cleanup(older_than_seconds, delete_unverified=delete_unverified)
            for t in (self._table, self._rewards.table, self._advantages.table)
        )


def _components(values: pa.Table, n: int) -> dict[str, torch.Tensor]:
    """list<name>/list<value> columns -> {name: (n,) float32, NaN where a sample lacks it}."""
    names_col = values.column("component_names").combine_chunks()
    vals_col = values.column("component_values").combine_chunks()
    names = pc.list_flatten(names_col).to_numpy(zero_copy_only=False)
    vals = pc.list_flatten(vals_col).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(names_col).to_numpy()
    out = {}
    for name in sorted(set(names.tolist())):
        column = np.full(n, np.nan, dtype=np.float32)
        mask = names == name
        column[parents[mask]] = vals[mask]
        out[name] = torch.from_numpy(column)
    return out
