"""SFT through `diffrl train` (`algorithm: sft`): supervised flow matching on a (prompt, image) parquet written here
(plain coloured squares) lowers its matching loss, and an RL run started from its checkpoint (`run.init_from`)
begins with the SFT run's last LoRA weights; bad SFT settings fail before any work."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from e2e_settings import TINY, TINY_SIZES
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from diffrl.configs.loader import ConfigError
from diffrl.configs.schema import load_experiment
from diffrl.engines.store.png import ZLIB_DEFAULT, encode_png
from diffrl.flows.build import build_engines
from diffrl.flows.train import train

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
# 8 rows a step in 4 optimizer steps, LoRA rank 16 (as TINY's RL run, so its weights fit that run)
SFT = [
    *TINY_SIZES,
    "algorithm={name: sft}",
    "data.sample_source=offline",
    "data.train=squares.parquet",
    "data.val=generator:ocr",
    "rollout.group_size=1",
    "rollout.prompts_per_step=8",
    "train.mini_batch_prompts=2",
    "train.lora_rank=16",
    "train.lora_alpha=32",
    "train.lr=1.0e-2",
    "run.name=sft",
    "run.experiment=diffrl-sft",
    "run.steps=3",
]


def write_squares(path: str, size: int = 32) -> None:
    """Solid-colour squares, four of each colour, prompt 'a <colour> square'."""
    rows = [(f"a {name} square", np.full((size, size, 3), rgb, np.uint8)) for name, rgb in COLOURS.items()] * 4
    table = pa.table(
        {
            "prompt": [p for p, _ in rows],
            "uid": [f"square-{k}" for k in range(len(rows))],
            "image": pa.array([encode_png(image, ZLIB_DEFAULT) for _, image in rows], pa.binary()),
        }
    )
    pq.write_table(table, path)


def _history(workdir, experiment: str, key: str) -> dict[int, float]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def _lora(run_dir: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(run_dir, "checkpoints", f"step_{step}", "trainable.safetensors"))


def test_sft_lowers_the_matching_loss_and_an_rl_run_starts_from_its_weights(workdir, monkeypatch):
    """The RL run's one update is skipped (an injected NaN loss: a non-finite gradient skips the optimizer step), so
    its checkpoint holds exactly the weights it started from."""
    write_squares(str(workdir / "squares.parquet"))
    train(config=None, overrides=SFT)
    fm = _history(workdir, "diffrl-sft", "actor/fm_loss")
    assert sorted(fm) == [1, 2, 3]
    assert fm[3] < 0.9 * fm[1]  # measured 1.557, 1.504, 1.312 (seed 0)
    assert _history(workdir, "diffrl-sft", "sft/num_samples") == {1: 8.0, 2: 8.0, 3: 8.0}
    assert not _history(workdir, "diffrl-sft", "critic/rewards/mean")  # no reward, no advantages

    monkeypatch.setenv("DIFFRL_INJECT_FAULT", "loss@1:nan")
    train(config=None, overrides=[*TINY, "run.steps=1", "run.name=rl", "run.init_from=sft"])
    assert _history(workdir, "diffrl-quickstart", "actor/skipped_steps") == {1: 1.0}
    sft, rl = _lora("runs/sft", 3), _lora("runs/rl", 1)
    assert sorted(sft) == sorted(rl)
    assert all(torch.equal(sft[name], rl[name]) for name in sft)
    assert any(bool(t.abs().max() > 0) for name, t in sft.items() if "lora_B" in name)  # trained (B starts at 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.sample_source=online"], r"algorithm 'sft' trains on the \(prompt, image\) rows of a dataset"),
        (["rollout.group_size=2"], r"set rollout.group_size: 1"),
        (["data.train=squares.txt"], r"an SFT dataset is a .parquet or .lance path"),
        (["data.train=missing.parquet"], r"'missing.parquet': the SFT dataset file does not exist"),
    ],
)
def test_bad_sft_settings_fail_before_any_work(workdir, overrides, message):
    write_squares(str(workdir / "squares.parquet"))
    with pytest.raises((ConfigError, ValueError), match=message):
        build_engines(load_experiment(None, [*SFT, *overrides]))
    assert not os.path.exists("runs/sft")
