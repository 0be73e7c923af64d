"""SFT's (prompt, image) dataset: a parquet file and a Lance table with the same rows read the same; a step's rows
come back in its order, resized; missing columns, wrong types and wrong paths are errors naming them."""

from __future__ import annotations

import json
import os

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from diffrl.engines.store.image_dataset import ImageDataset
from diffrl.engines.store.png import ZLIB_DEFAULT, encode_png
from diffrl.engines.store.prompts import prompt_uid


def _rows(n: int = 7) -> pa.Table:
    """Row k: prompt 'square k', an 8x8 image of value 30 k (row k is told apart by its pixels)."""
    images = [encode_png(np.full((8, 8, 3), 30 * k, np.uint8), ZLIB_DEFAULT) for k in range(n)]
    return pa.table({"prompt": [f"square {k}" for k in range(n)], "image": pa.array(images, pa.binary())})


def test_parquet_and_lance_read_the_same_rows(tmp_path):
    table = _rows()
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=3)  # rows 0-2, 3-5, 6: three row groups
    lance.write_dataset(table, str(tmp_path / "rows.lance"))
    for name in ("rows.parquet", "rows.lance"):
        data = ImageDataset(str(tmp_path / name))
        records = data.prompts().records
        assert [r.prompt for r in records] == [f"square {k}" for k in range(7)]
        assert [r.metadata["row"] for r in records] == list(range(7))
        assert records[2].uid == prompt_uid(2, "square 2")
        images = data.images([6, 1, 4, 1], 8, 8)  # across row groups, in the step's order, a row twice
        assert images.dtype == torch.uint8 and images.shape == (4, 8, 8, 3)
        assert images[:, 0, 0, 0].tolist() == [180, 30, 120, 30]
        assert data.images([5], 16, 16).shape == (1, 16, 16, 3)  # resized to the run's resolution
        assert data.images([5], 16, 16)[0, 7, 7, 0] == 150  # a solid colour stays that colour


def test_uids_come_from_the_uid_column(tmp_path):
    table = _rows(3).append_column("uid", pa.array(["a", "b", "c"]))
    pq.write_table(table, tmp_path / "rows.parquet")
    assert [r.uid for r in ImageDataset(str(tmp_path / "rows.parquet")).prompts().records] == ["a", "b", "c"]


def test_bad_datasets_are_errors_naming_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"data.train '.*rows.csv': an SFT dataset is a .parquet or .lance path"):
        ImageDataset(str(tmp_path / "rows.csv"))
    with pytest.raises(ValueError, match="the SFT dataset file does not exist"):
        ImageDataset(str(tmp_path / "none.parquet"))
    with pytest.raises(ValueError, match="no Lance table there"):
        ImageDataset(str(tmp_path / "none.lance"))
    pq.write_table(_rows().drop_columns(["image"]), tmp_path / "no_image.parquet")
    with pytest.raises(ValueError, match=r"needs the columns prompt \(str\) and image .*; it has \['prompt'\]"):
        ImageDataset(str(tmp_path / "no_image.parquet"))
    pq.write_table(_rows().set_column(1, "image", pa.array(range(7))), tmp_path / "ints.parquet")
    with pytest.raises(
        ValueError, match=r"column 'image' must hold PNG/JPEG bytes \(binary\) or a path \(str\); it holds int64"
    ):
        ImageDataset(str(tmp_path / "ints.parquet"))
    pq.write_table(_rows().set_column(0, "prompt", pa.array(range(7))), tmp_path / "prompts.parquet")
    with pytest.raises(ValueError, match=r"column 'prompt' must hold str; it holds int64"):
        ImageDataset(str(tmp_path / "prompts.parquet"))
    pq.write_table(_rows().slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="the SFT dataset is empty"):
        ImageDataset(str(tmp_path / "empty.parquet")).prompts()


def test_generator_shapes_renders_scenes_that_satisfy_their_prompts(tmp_path, monkeypatch):
    """`data.train: generator:shapes` with `algorithm: sft`: data.num_generated rendered scenes at the run's
    resolution, written once to a parquet in runs/<name>, balanced over the tags, and each image is what its
    prompt asks for by geneval_lite's own detector (strict accuracy)."""
    from diffrl.configs.schema import load_experiment
    from diffrl.flows.build_preference import sft_dataset
    from diffrl.shapes.geneval_lite import GenevalLiteOptions, geneval_lite
    from diffrl.shapes.scenes import TAGS

    monkeypatch.chdir(tmp_path)
    overrides = ["algorithm={name: sft}", "data.sample_source=offline", "data.train=generator:shapes"]
    overrides += ["data.num_generated=24", "rollout.group_size=1", "run.name=sft-shapes"]
    cfg = load_experiment("shapes_quick", overrides)
    dataset = sft_dataset(cfg)
    path = tmp_path / "runs" / "sft-shapes" / f"sft_shapes_24x{cfg.rollout.height}px_seed{cfg.run.seed}.parquet"
    assert os.path.abspath(dataset.path) == str(path) and path.exists()
    records = dataset.prompts().records
    assert len(records) == 24
    table = pq.read_table(path)
    truths = table.column("ground_truth").to_pylist()
    assert sorted(json.loads(t)["tag"] for t in truths) == sorted(TAGS * 4)
    images = dataset.images(list(range(24)), cfg.rollout.height, cfg.rollout.width)
    assert images.shape == (24, cfg.rollout.height, cfg.rollout.width, 3)
    out = geneval_lite(GenevalLiteOptions())(images, [r.prompt for r in records], [{"ground_truth": t} for t in truths])
    assert out.info["accuracy"] == [1.0] * 24
    written = path.stat().st_mtime_ns
    sft_dataset(cfg)  # a rerun (resume) reads the same file
    assert path.stat().st_mtime_ns == written
