"""SFT's dataset: (prompt, image) rows in a parquet file or a Lance table (images only; video rows are not read).

Legend: b rows of a step, H/W the run's resolution.

Columns:
    prompt   str
    image    the image: PNG/JPEG bytes, or a path (str) to an image file (relative to the dataset's folder)
    uid      (optional) a stable row id; default: a hash of (row, prompt)
Only the prompt (and uid) columns are read up front; a step reads the images of its own rows, resizes them to the run's
resolution and VAE-encodes them (diffrl/engines/step/generate.py `dataset_samples`).
"""

from __future__ import annotations

import bisect

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from diffrl.engines.store import fs
from diffrl.engines.store.preference import load_image, to_uint8
from diffrl.engines.store.prompts import PromptDataset, PromptRecord, prompt_uid
from diffrl.engines.store.tables import LanceTable

FORMATS = (".parquet", ".lance")


def _kind(path: str) -> str:
    """The format of `path` from its suffix (ValueError naming data.train and the formats otherwise)."""
    for suffix in FORMATS:
        if str(path).rstrip("/").lower().endswith(suffix):
            return suffix
    raise ValueError(
        f"data.train {path!r}: an SFT dataset is a {' or '.join(FORMATS)} path with columns prompt and image"
    )


def check_schema(path: str, schema: pa.Schema) -> None:
    """ValueError naming the column for a missing prompt/image column or one of another type."""
    wanted = {
        "prompt": (pa.types.is_string, pa.types.is_large_string),
        "image": (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_string, pa.types.is_large_string),
    }
    for name, allowed in wanted.items():
        if name not in schema.names:
            raise ValueError(
                f"data.train {path!r}: an SFT dataset needs the columns prompt (str) and image (PNG/JPEG bytes or a "
                f"path); it has {sorted(schema.names)}"
            )
        kind = schema.field(name).type
        if not any(is_kind(kind) for is_kind in allowed):
            what = "str" if name == "prompt" else "PNG/JPEG bytes (binary) or a path (str)"
            raise ValueError(f"data.train {path!r}: column {name!r} must hold {what}; it holds {kind}")


class ImageDataset:
    """The (prompt, image) rows of a parquet file or a Lance table; row k is `PromptRecord.metadata["row"]` = k."""

    def __init__(self, path: str, *, storage_options: dict | None = None):
        self.path, self.kind = path, _kind(path)
        self.storage_options = storage_options
        if self.kind == ".lance":
            self._lance = LanceTable(path, storage_options=storage_options).dataset()
            if self._lance is None:
                raise ValueError(f"data.train {path!r}: no Lance table there")
            schema = self._lance.schema
        else:
            if not fs.exists(path, storage_options):
                raise ValueError(f"data.train {path!r}: the SFT dataset file does not exist")
            with fs.open(path, "rb", storage_options) as f:
                meta = pq.ParquetFile(f).metadata
                schema = meta.schema.to_arrow_schema()
                # the first row of each row group, to read only the groups a step's rows lie in
                self._starts = [0]
                for g in range(meta.num_row_groups):
                    self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        check_schema(path, schema)
        self._id_columns = ["prompt"] + ["uid"] * ("uid" in schema.names)

    def prompts(self) -> PromptDataset:
        """Every row as a PromptRecord (uid: the uid column, or a hash of (row, prompt)); images are not read."""
        table = self._read(self._id_columns)
        if table.num_rows == 0:
            raise ValueError(f"data.train {self.path!r}: the SFT dataset is empty")
        prompts = table.column("prompt").to_pylist()
        if "uid" in table.column_names:
            uids = [str(u) for u in table.column("uid").to_pylist()]
        else:
            uids = [prompt_uid(i, p) for i, p in enumerate(prompts)]
        records = [PromptRecord(uid=u, prompt=p, metadata={"row": i}) for i, (u, p) in enumerate(zip(uids, prompts))]
        return PromptDataset(records, source=self.path)

    def images(self, rows: list[int], height: int, width: int) -> torch.Tensor:
        """(b, H, W, 3) uint8: the images of `rows`, in that order, resized to H x W."""
        values = self._image_values(sorted(set(rows)))
        base_dir = fs.parent(self.path)
        return torch.stack([to_uint8(load_image(values[r], base_dir), height, width) for r in rows])

    def _read(self, columns: list[str]) -> pa.Table:
        if self.kind == ".lance":
            return self._lance.to_table(columns=columns)
        with fs.open(self.path, "rb", self.storage_options) as f:
            return pq.read_table(f, columns=columns)

    def _image_values(self, rows: list[int]) -> dict[int, object]:
        """{row: its image cell} for sorted, distinct `rows`."""
        if self.kind == ".lance":
            return dict(zip(rows, self._lance.take(rows, columns=["image"]).column("image").to_pylist()))
        values = {}
        with fs.open(self.path, "rb", self.storage_options) as f:
            reader = pq.ParquetFile(f)
            groups = sorted({bisect.bisect_right(self._starts, r) - 1 for r in rows})
            for g in groups:
                cells = reader.read_row_group(g, columns=["image"]).column("image").to_pylist()
                for r in rows:
                    if self._starts[g] <= r < self._starts[g + 1]:
                        values[r] = cells[r - self._starts[g]]
        return values
