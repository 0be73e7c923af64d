"""Token trajectories in Lance: one row per sampled response of an autoregressive policy.

Row: (step, group_id, sample_index) key, policy_version (the weights that sampled it), prompt text, images by
reference (paths, never pixels), prompt_ids (unpadded), response_ids and per-token log_probs (the response's own
tokens, up to and including its end token; no padding stored). Masks and lengths follow from the list lengths, so
what is stored cannot disagree with itself. Append-only; the first committed row of a key wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from diffrl.engines.store.samples import SAMPLE_KEY, key_table
from diffrl.engines.store.tables import LanceTable, first_rows, new_write_id

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64()),
        pa.field("group_id", pa.string()),
        pa.field("sample_index", pa.int64()),
        pa.field("policy_version", pa.int64()),
        pa.field("prompt", pa.string()),
        pa.field("images", pa.list_(pa.string())),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("log_probs", pa.list_(pa.float32())),
        pa.field("write_id", pa.string()),
    ]
)


@dataclass
class TokenRows:
    """Rows of one step, in key order, padded for a forward: prompt_ids (B, P) left-padded with prompt_mask;
    response_ids, log_probs, mask (B, T) right-padded; lengths (B,)."""

    group_ids: list[str]
    sample_index: list[int]
    policy_version: list[int]
    prompts: list[str]
    images: list[tuple[str, ...]]
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    log_probs: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor


def _pad(rows: list[list], *, left: bool, dtype: torch.dtype, value=0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max len) values and mask from ragged lists."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        out[i, cols] = torch.tensor(r, dtype=dtype)
        mask[i, cols] = True
    return out, mask


class TokenTrajectoryTable:
    """The append-only Lance table of token trajectories."""

    def __init__(self, uri: str, *, storage_options: dict | None = None):
        self.table = LanceTable(uri, storage_options=storage_options)

    def write(
        self,
        step: int,
        group_ids: list[str],
        sample_index: list[int],
        *,
        policy_version: int,
        prompts: list[str],
        images: list[tuple[str, ...]],
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        log_probs: list[list[float]],
    ) -> None:
        """Append one write of rows (one per response); ragged lists are unpadded."""
        keys = key_table(group_ids, np.asarray(sample_index))
        n = keys.num_rows
        lists = {"prompts": prompts, "images": images, "prompt_ids": prompt_ids, "response_ids": response_ids}
        for name, values in {**lists, "log_probs": log_probs}.items():
            if len(values) != n:
                raise ValueError(f"{name} must hold one entry per row ({n}); got {len(values)}")
        if any(len(r) != len(lp) for r, lp in zip(response_ids, log_probs)):
            raise ValueError("log_probs must hold one value per response token")
        columns = {
            "step": pa.array([step] * n, pa.int64()),
            **{name: keys.column(name) for name in SAMPLE_KEY},
            "policy_version": pa.array([policy_version] * n, pa.int64()),
            "prompt": pa.array(prompts, pa.string()),
            "images": pa.array([list(i) for i in images], pa.list_(pa.string())),
            "prompt_ids": pa.array(prompt_ids, pa.list_(pa.int32())),
            "response_ids": pa.array(response_ids, pa.list_(pa.int32())),
            "log_probs": pa.array(log_probs, pa.list_(pa.float32())),
            "write_id": pa.array([new_write_id()] * n, pa.string()),
        }
        self.table.append(pa.table(columns, schema=TOKEN_SCHEMA))

    def read(self, step: int) -> TokenRows:
        """The rows of one step (first write per key wins), sorted by (group_id, sample_index)."""
        rows = self.table.scan([f.name for f in TOKEN_SCHEMA], filter=f"step = {int(step)}")
        if rows is None or rows.num_rows == 0:
            raise ValueError(f"{self.table.uri}: no token trajectories for step {step}")
        rows = first_rows(rows, SAMPLE_KEY).sort_by([(k, "ascending") for k in SAMPLE_KEY]).to_pylist()
        prompt_ids, prompt_mask = _pad([r["prompt_ids"] for r in rows], left=True, dtype=torch.long)
        response_ids, mask = _pad([r["response_ids"] for r in rows], left=False, dtype=torch.long)
        log_probs, _ = _pad([r["log_probs"] for r in rows], left=False, dtype=torch.float32, value=0.0)
        return TokenRows(
            group_ids=[r["group_id"] for r in rows],
            sample_index=[r["sample_index"] for r in rows],
            policy_version=[r["policy_version"] for r in rows],
            prompts=[r["prompt"] for r in rows],
            images=[tuple(r["images"]) for r in rows],
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            log_probs=log_probs,
            mask=mask,
            lengths=mask.sum(dim=1),
        )
