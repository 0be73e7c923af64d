"""The build-time checks of a token run (diffrl.flows.build_tokens): what Janus image generation does not take, and
CFG on a causal LM, are ValueErrors naming the setting."""

from __future__ import annotations

import os

import pytest

from diffrl.configs.schema import load_experiment
from diffrl.flows.build_tokens import check_image_token_config

# a test config: the tiny random Janus (tests/configs)
JANUS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "janus_shapes_grpo.yaml")


def test_build_checks_refuse_what_janus_does_not_take():
    cfg = load_experiment(JANUS_CONFIG, [])
    check_image_token_config(cfg, janus=True)
    with pytest.raises(ValueError, match="in-process only"):
        check_image_token_config(load_experiment(JANUS_CONFIG, ["rollout.engine=vllm"]), janus=True)
    with pytest.raises(ValueError, match="Janus image generation is not supported asynchronously"):
        one_step_off = ["train.lora=true", "run.async.max_staleness=1", "train.rollout_correction=tis"]
        check_image_token_config(load_experiment(JANUS_CONFIG, one_step_off), janus=True)
    with pytest.raises(ValueError, match="full distribution"):
        check_image_token_config(load_experiment(JANUS_CONFIG, ["rollout.top_p=0.9"]), janus=True)
    with pytest.raises(ValueError, match="overlong_buffer=0"):
        dapo = load_experiment(JANUS_CONFIG, ["algorithm=dapo", "algorithm.overlong_buffer=4"])
        check_image_token_config(dapo, janus=True)
    with pytest.raises(ValueError, match="without classifier-free guidance"):
        check_image_token_config(load_experiment("omni_quick", ["rollout.guidance_scale=3.0"]), janus=False)
