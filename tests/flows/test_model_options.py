"""`model.options`: the architecture's own sampling knobs reach its adapter; one it does not take is bad input."""

from __future__ import annotations

import pytest

from diffrl.configs.schema import load_experiment
from diffrl.engines import cluster
from diffrl.flows.build import build_engines
from diffrl.flows.errors import report

TINY = [
    "model.path=tiny:wan22",
    "model.dtype=fp32",
    "model.device=cpu",
    "reward.components=[{name: jpeg_compressibility}]",
    "data.val=null",
    "data.num_generated=4",
    "data.num_val_prompts=0",
    "rollout.height=16",
    "rollout.width=16",
    "rollout.num_frames=5",
    "rollout.group_size=2",
    "rollout.prompts_per_step=1",
    "train.mini_batch_prompts=1",
    "run.name=model-options",
]


def test_an_option_reaches_the_adapter_and_an_unknown_one_is_a_one_line_input_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_experiment("wan22_dance_grpo", [*TINY, "model.options={guidance_scale_2: 2.5}"])
    engines = build_engines(cfg, durable=False)
    try:
        assert engines.adapter.guidance_scale_2 == 2.5 and engines.rollout.adapter.guidance_scale_2 == 2.5
    finally:
        cluster.drop("model-options")
    cfg = load_experiment("wan22_dance_grpo", [*TINY, "model.options={guidance_scale_3: 2.5}"])
    with pytest.raises(
        ValueError, match=r"unknown arguments \['guidance_scale_3'\]; it takes only guidance_scale_2"
    ) as e:
        build_engines(cfg, durable=False)
    failure = report(e.value)  # `diffrl train` prints it as bad input: exit 2, no rerun advice
    assert failure.code == 2 and not failure.rerun


def test_options_must_be_a_mapping():
    with pytest.raises(Exception, match="model.options"):
        load_experiment("wan22_dance_grpo", [*TINY, "model.options=3"])
