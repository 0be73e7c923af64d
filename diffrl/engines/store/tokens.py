"""Token trajectories in Lance: the trajectory store of an autoregressive run, one row per sampled response.

The same store as the diffusion runs' (diffrl/engines/store/trajectories.py: `runs/<run>/trajectories.lance` with the
rewards.lance and advantages.lance siblings, one commit per (step, chunk), the first committed write of a chunk wins,
steps stored by their step number), with token rows instead of latent rows:

    run, step, chunk, chunk_row, group_id, sample_index   the row's identity, as in every trajectory table
    prompt, images, audios                                the user text, its images and its audio clips by path
                                                          (never pixels or waveforms)
    prompt_ids, response_ids, log_probs                   the prompt's tokens, the response's own tokens (up to and
                                                          including its end token, no padding) and their rollout
                                                          log-probs: masks and lengths follow from the list lengths
    response, seed, metadata (JSON), policy_version, write_id
    image                                                 only in the table of a policy whose responses are image
                                                          tokens (Janus): the decoded image as PNG, what the reward
                                                          scored (a table is made with or without it by its first
                                                          rows; the other kind of rows is refused)

There are no latents: retention has nothing to drop, and a row is a few hundred bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from diffrl.engines.numbering import step_number
from diffrl.engines.store.png import encode_batch
from diffrl.engines.store.records import decode_images
from diffrl.engines.store.samples import key_table
from diffrl.engines.store.tables import sql_in
from diffrl.engines.store.trajectories import SampleKeys, TrajectoryStore
from diffrl.engines.token_trajectories import TokenTrajectories

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("chunk", pa.int64()),
        pa.field("chunk_row", pa.int64()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("prompt", pa.string()),
        pa.field("images", pa.list_(pa.string())),
        pa.field("audios", pa.list_(pa.string())),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("log_probs", pa.list_(pa.float32())),
        pa.field("response", pa.string()),
        pa.field("seed", pa.int64()),
        pa.field("metadata", pa.string()),
        pa.field("policy_version", pa.int64()),
        pa.field("write_id", pa.string()),
    ],
    metadata={"diffrl.rows": "tokens"},
)
IMAGE_COLUMN = "image"  # PNG bytes of an image-token row's decoded image
IMAGE_TOKEN_SCHEMA = TOKEN_SCHEMA.append(pa.field(IMAGE_COLUMN, pa.binary()))


def token_rows(
    traj: TokenTrajectories, *, run: str, step: int, chunk: int, write_id: str, compress_level: int = 1
) -> pa.Table:
    """One chunk's samples as Arrow rows of TOKEN_SCHEMA (`step` is the step number the table holds), with the
    image column (IMAGE_TOKEN_SCHEMA) when the responses are image tokens with decoded images."""
    n = len(traj)
    columns = {
        "run": pa.array([run] * n, pa.string()),
        "step": pa.array([step] * n, pa.int64()),
        "chunk": pa.array([chunk] * n, pa.int64()),
        "chunk_row": pa.array(np.arange(n, dtype=np.int64)),
        "group_id": pa.array(traj.group_ids, pa.string()),
        "sample_index": pa.array(traj.sample_index.numpy().astype(np.int64)),
        "prompt": pa.array(traj.prompts, pa.string()),
        "images": pa.array([list(p) for p in traj.image_paths], pa.list_(pa.string())),
        "audios": pa.array([list(p) for p in traj.audio_paths], pa.list_(pa.string())),
        "prompt_ids": pa.array([t.tolist() for t in traj.prompt_ids], pa.list_(pa.int32())),
        "response_ids": pa.array([t.tolist() for t in traj.response_ids], pa.list_(pa.int32())),
        "log_probs": pa.array([t.float().tolist() for t in traj.log_probs], pa.list_(pa.float32())),
        "response": pa.array(traj.responses, pa.string()),
        "seed": pa.array(traj.seeds.numpy().astype(np.int64)),
        "metadata": pa.array([json.dumps(m, sort_keys=True) for m in traj.metadata], pa.string()),
        "policy_version": pa.array([traj.policy_version] * n, pa.int64()),
        "write_id": pa.array([write_id] * n, pa.string()),
    }
    if traj.images is None:
        return pa.table(columns, schema=TOKEN_SCHEMA)
    blobs = encode_batch(traj.images.detach().cpu().contiguous().numpy(), compress_level)
    columns[IMAGE_COLUMN] = pa.array(blobs, pa.binary())
    return pa.table(columns, schema=IMAGE_TOKEN_SCHEMA)


def from_token_rows(rows: pa.Table) -> TokenTrajectories:
    """Arrow rows (already in sample order) back to TokenTrajectories."""
    data = rows.to_pydict()
    versions = set(data["policy_version"])
    return TokenTrajectories(
        prompts=data["prompt"],
        group_ids=data["group_id"],
        sample_index=torch.tensor(data["sample_index"], dtype=torch.long),
        seeds=torch.tensor(data["seed"], dtype=torch.long),
        image_paths=[tuple(p) for p in data["images"]],
        prompt_ids=[torch.tensor(p, dtype=torch.long) for p in data["prompt_ids"]],
        response_ids=[torch.tensor(r, dtype=torch.long) for r in data["response_ids"]],
        log_probs=[torch.tensor(lp, dtype=torch.float32) for lp in data["log_probs"]],
        responses=data["response"],
        metadata=[json.loads(m) for m in data["metadata"]],
        policy_version=min(versions) if versions else 0,
        audio_paths=[tuple(p) for p in data.get("audios", [])],  # none from a table without the audios column
        images=decode_images(data[IMAGE_COLUMN], 0) if data.get(IMAGE_COLUMN) else None,
    )


class TokenStore(TrajectoryStore):
    """The trajectory store of token rows: the diffusion store's chunks, keys, reward and advantage tables and
    retention, with the row codec above. The latent methods have nothing to do here."""

    def latent_shape(self) -> tuple[int, ...] | None:
        return None  # token rows hold no latents

    def _check_layout(self, traj, step: int, chunk: int) -> None:
        if not isinstance(traj, TokenTrajectories):
            raise ValueError(f"{self.uri}: a token store takes TokenTrajectories; got {type(traj).__name__}")
        meta = self._table.schema_metadata()
        if meta and meta.get("diffrl.rows") != "tokens":
            raise ValueError(f"{self.uri}: this table holds diffusion rows, not token rows. Nothing was written.")
        names = self._table.dataset().schema.names if meta else []
        if meta and (IMAGE_COLUMN in names) != (traj.images is not None):
            held, given = ("image-token rows", "text") if IMAGE_COLUMN in names else ("text rows", "image-token")
            raise ValueError(
                f"{self.uri}: this table holds {held}; diffrl appends no {given} rows to it (another model than the "
                "run's first): train under a new run.name. Nothing was written."
            )
        if meta and "audios" not in names:
            raise ValueError(
                f"{self.uri}: this table was written before token rows had an audios column; diffrl appends no rows "
                "of another layout to it: train under a new run.name. Nothing was written."
            )

    def _rows(self, traj, *, run: str, step: int, chunk: int, write_id: str) -> pa.Table:
        return token_rows(
            traj,
            run=run,
            step=step_number(step),
            chunk=chunk,
            write_id=write_id,
            compress_level=self.png_compress_level,
        )

    def _read_rows(
        self, step: int, keys: pa.Table, where_extra: str, *, with_latents: bool, with_images: bool
    ) -> TokenTrajectories:
        """Scan the committed rows `keys` of `step` (narrowed by `where_extra`) into TokenTrajectories."""
        winners = pc.unique(keys.column("write_id")).to_pylist()
        where = f"step = {step_number(step)} AND {sql_in('write_id', winners)}" + where_extra
        stored = set(self._table.dataset().schema.names)  # a table from before the audios column reads without it
        wanted = [f.name for f in IMAGE_TOKEN_SCHEMA if f.name != IMAGE_COLUMN or with_images]
        data = self._table.scan([name for name in wanted if name in stored], filter=where)
        if data is None or data.num_rows != keys.num_rows:
            raise ValueError(
                f"{self.uri}: step {step} changed while being read ({0 if data is None else data.num_rows} rows, "
                f"expected {keys.num_rows}); retry the read"
            )
        order = pc.sort_indices(data, sort_keys=[("chunk", "ascending"), ("chunk_row", "ascending")])
        return from_token_rows(data.take(order))

    def _keys(self, step: int, keys: SampleKeys) -> pa.Table:
        if isinstance(keys, TokenTrajectories):
            return key_table(keys.group_ids, keys.sample_index.numpy())
        return super()._keys(step, keys)

    def _prompts(self, step: int, keys: SampleKeys, table: pa.Table) -> pa.Array:
        if isinstance(keys, TokenTrajectories):
            return pa.array(keys.prompts, pa.string())
        return super()._prompts(step, keys, table)

    def image(self, step: int, group_id: str, sample_index: int):
        """The decoded image of one image-token row (Janus); text rows hold none."""
        dataset = self._table.dataset()
        if dataset is None or IMAGE_COLUMN not in dataset.schema.names:
            raise ValueError(f"{self.uri}: token rows hold no generated image (their prompts' images are files)")
        return super().image(step, group_id, sample_index)

    def drop_latents(self, keep_latents_steps: int, current_step: int) -> list[int]:
        return []  # nothing to drop: token rows are small and stay

    def compact(self) -> None:
        """Merge the per-append fragments of the three tables and drop raced duplicates physically."""
        self._delete_losers()
        self._table.compact()
        self._rewards.table.compact()
        self._advantages.table.compact()
