"""Read back what each logger of a run wrote, from its own files: MLflow's database, TensorBoard's event files, W&B's
offline run files. Values are {metric name: [(step, value), ...]} in the order logged, NaN as NaN."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys


def mlflow_scalars(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = client.get_run(run_id).data.metrics
    # MLflow's database stores +inf as the largest float (and -inf as its negative)
    value = {sys.float_info.max: math.inf, -sys.float_info.max: -math.inf}
    return {
        key: [(m.step, value.get(m.value, m.value)) for m in client.get_metric_history(run_id, key)] for key in keys
    }


def _accumulator(folder: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # every event kept (no sampling); what a later process purged (its purge_step) is left out, as TensorBoard shows it
    sizes = {"scalars": 0, "images": 0, "tensors": 0}
    accumulator = EventAccumulator(folder, size_guidance=sizes, purge_orphaned_data=True)
    accumulator.Reload()
    return accumulator


def tensorboard_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    acc = _accumulator(folder)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_images(folder: str) -> dict[str, list[tuple[int, int, int]]]:
    """{key: [(step, width, height), ...]}."""
    acc = _accumulator(folder)
    return {tag: [(e.step, e.width, e.height) for e in acc.Images(tag)] for tag in acc.Tags()["images"]}


def _wandb_records(path: str) -> list[bytes]:
    """The records of a .wandb file. It is W&B's LevelDB-style log (a 7-byte ":W&B" header, then 32 KiB blocks of
    chunks, each with a crc32c, a length and a type: full, first, middle or last); the wandb package no longer ships
    a reader in Python (its service, which writes it, is in Go)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(pending)
            pending = b""
    return records


def _wandb_items(folder: str, kind: str) -> list[dict]:
    """The `kind` records ("history", "config") of the offline runs under `folder` (runs/<name>, which holds wandb/),
    oldest run first, each as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for run in sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*"))):
        for raw in _wandb_records(glob.glob(os.path.join(run, "run-*.wandb"))[0]):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == kind:
                items = record.history.item if kind == "history" else record.config.update
                found.append({_key(item): json.loads(item.value_json) for item in items})
    return found


def _key(item) -> str | tuple:
    """An item's name: a metric's ("rollout/samples"), or an image's or table's field as a tuple (("rollout", "_type")),
    apart from the metrics whose names start the same."""
    if item.key:
        return item.key
    return item.nested_key[0] if len(item.nested_key) == 1 else tuple(item.nested_key)


def wandb_history(folder: str) -> list[dict]:
    """Every history row the offline runs under `folder` logged, oldest run first."""
    return _wandb_items(folder, "history")


def wandb_config(folder: str) -> dict:
    """The W&B config the offline runs under `folder` recorded, later updates over earlier ones."""
    config: dict = {}
    for update in _wandb_items(folder, "config"):
        config.update(update)
    return config


def wandb_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """The metrics of the W&B history rows as {key: [(step, value)]}; images and tables left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in wandb_history(folder):
        for key, value in row.items():
            if isinstance(key, str) and not key.startswith("_") and isinstance(value, (int, float)):
                out.setdefault(key, []).append((row["_step"], float(value)))
    return out


def same(a: float, b: float, rel: float = 1e-6) -> bool:
    """Equal values, NaN equal to NaN (TensorBoard keeps float32: `rel` covers its rounding)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def assert_same_scalars(expected: dict, got: dict, who: str) -> None:
    """`got` has exactly `expected`'s metric names, each at the same steps with the same values."""
    assert sorted(got) == sorted(expected), (who, sorted(set(got) ^ set(expected)))
    for key, values in expected.items():
        assert [s for s, _ in got[key]] == [s for s, _ in values], (who, key, values, got[key])
        assert all(same(a, b) for (_, a), (_, b) in zip(values, got[key])), (who, key, values, got[key])
