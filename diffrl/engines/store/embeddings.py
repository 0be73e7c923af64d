"""The persistent prompt-embedding cache: a Lance table keyed by (model fingerprint, prompt).

Each row holds one prompt's encoding as safetensors bytes: any tensor names, shapes and dtypes
(bf16 included) round-trip bit-exactly, and the padded length L may differ per prompt. The
lookup key is sha256(fingerprint, prompt) in hex, so filters never quote user text.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from diffrl.engines.store.tables import LanceTable, first_rows, new_write_id, sql_in

_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string()),
        pa.field("fingerprint", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("encoding", pa.large_binary()),
        pa.field("write_id", pa.string()),
    ]
)
_LOOKUP_BATCH = 512  # keys per IN (...) filter


def cache_key(fingerprint: str, prompt: str) -> str:
    """Row key of (fingerprint, prompt)."""
    return hashlib.sha256(f"{fingerprint}\x00{prompt}".encode()).hexdigest()


class EmbeddingCache:
    """Prompt encodings of one or more text encoders (told apart by `fingerprint`)."""

    def __init__(self, uri: str, *, storage_options: dict | None = None):
        self.table = LanceTable(uri, storage_options=storage_options)
        self.table.dataset()  # a corrupt table fails here, naming its path
        # Keys known to be stored, read once: a rollout meeting new prompts every step (a generator's) then asks
        # the table nothing. Only this handle's puts are added, so another process's later puts are not seen (a
        # miss encodes the prompt again; the put of a stored key is a no-op).
        self._keys: set[str] | None = None

    def _known(self) -> set[str]:
        if self._keys is None:
            rows = self.table.scan(["key"])
            self._keys = set() if rows is None else set(rows.column("key").to_pylist())
        return self._keys

    def _lookup(self, keys: list[str], columns: list[str]) -> pa.Table:
        parts = []
        for i in range(0, len(keys), _LOOKUP_BATCH):
            rows = self.table.scan(["key", *columns, "write_id"], filter=sql_in("key", keys[i : i + _LOOKUP_BATCH]))
            if rows is not None:
                parts.append(rows)
        if not parts:
            return _SCHEMA.empty_table().select(["key", *columns])
        # A raced duplicate put keeps the first committed row (first in table order).
        return first_rows(pa.concat_tables(parts), ["key"])

    def get(self, fingerprint: str, prompts: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """prompt -> {tensor name: tensor with batch dim 1} for the cached prompts; others absent."""
        known = self._known()
        keys = {k: p for p in dict.fromkeys(prompts) if (k := cache_key(fingerprint, p)) in known}
        if not keys:
            return {}
        rows = self._lookup(list(keys), ["encoding"])
        found = rows.column("key").to_pylist()
        blobs = rows.column("encoding").to_pylist()
        return {keys[k]: load_tensors(blob) for k, blob in zip(found, blobs)}

    def put(self, fingerprint: str, encodings: dict[str, dict[str, torch.Tensor]]) -> int:
        """Store encodings of prompts not cached yet (idempotent); returns how many were written."""
        for prompt, tensors in encodings.items():
            if not tensors:
                raise ValueError(f"EmbeddingCache.put: prompt {prompt!r} has no tensors")
            for name, t in tensors.items():
                if not isinstance(t, torch.Tensor) or t.ndim < 1 or t.shape[0] != 1:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(
                        f"EmbeddingCache.put: {name!r} of prompt {prompt!r} must be a tensor with "
                        f"batch dim 1, got {shape}"
                    )
        keys = {cache_key(fingerprint, p): p for p in encodings}
        known = self._known()
        fresh = [k for k in keys if k not in known]
        if not fresh:
            return 0
        blobs = [save_tensors({n: t.detach().cpu().contiguous() for n, t in encodings[keys[k]].items()}) for k in fresh]
        write_id = new_write_id()
        self.table.append(
            pa.Table.from_pydict(
                {
                    "key": fresh,
                    "fingerprint": [fingerprint] * len(fresh),
                    "prompt": [keys[k] for k in fresh],
                    "encoding": blobs,
                    "write_id": [write_id] * len(fresh),
                },
                schema=_SCHEMA,
            )
        )
        known.update(fresh)
        return len(fresh)

    def __len__(self) -> int:
        rows = self.table.scan(["key"])
        return 0 if rows is None else len(pc.unique(rows.column("key")))

    def compact(self) -> None:
        """Merge the per-put fragments."""
        self.table.compact()
