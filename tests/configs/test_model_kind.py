"""An algorithm trains one model family: a token algorithm with a diffusion model, or the reverse, is a ValueError
naming the algorithms that fit, before anything loads; the token bundles select the token sampling settings."""

from __future__ import annotations

import json

import pytest

from diffrl.algorithms.catalog import get_algorithm
from diffrl.configs.loader import ConfigError
from diffrl.configs.schema import load_experiment
from diffrl.configs.train import TrainConfig
from diffrl.engines.rollout.tokens import TokenSampling
from diffrl.engines.train.tokens import TokenTrainer
from diffrl.models.kind import model_kind

TOKEN_NAMES = "['dapo', 'dr_grpo', 'grpo', 'gspo', 'sequence_dpo']"


def test_diffusion_algorithm_on_a_token_model_names_the_token_algorithms():
    with pytest.raises(ConfigError) as error:
        load_experiment(None, ["model.path=tiny:qwen3_omni"])  # the quickstart's diffusion_nft
    message = str(error.value)
    assert "'diffusion_nft' trains diffusion models" in message and "is autoregressive" in message
    assert f"choose algorithm one of {TOKEN_NAMES}" in message
    with pytest.raises(ConfigError, match="'dpo' trains diffusion models"):  # Diffusion-DPO, not sequence DPO
        load_experiment("omni_quick", ["algorithm=dpo"])


def test_token_algorithm_on_a_diffusion_model_names_the_diffusion_algorithms():
    with pytest.raises(ConfigError) as error:
        load_experiment(None, ["algorithm=gspo"])
    message = str(error.value)
    assert "'gspo' trains autoregressive models" in message and "'reference:shapes-small' is diffusion" in message
    assert "'flow_grpo'" in message and "'diffusion_nft'" in message and "'grpo'" not in message.split("one of")[1]


def test_token_bundles_select_token_sampling(tmp_path):
    cfg = load_experiment("omni_quick", ["algorithm=sequence_dpo", "rollout.top_p=0.9", "rollout.stop=['.']"])
    assert cfg.algorithm.needs.pairs and cfg.sampling == TokenSampling(
        max_new_tokens=4, temperature=1.0, top_p=0.9, stop=(".",), batch_size=128
    )
    with pytest.raises(ConfigError, match=r"rollout.temperature > 0 .*got 4, 0.0, 1.0"):
        load_experiment("omni_quick", ["rollout.temperature=0"])
    # folders are told apart by their files; a Hub id is not known before it loads
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    assert (model_kind(str(tmp_path / "lm")), model_kind(str(tmp_path / "pipe"))) == ("autoregressive", "diffusion")
    assert model_kind("Qwen/Qwen3-Omni-30B-A3B-Instruct") is None


def test_token_trainer_refuses_a_diffusion_algorithm():
    with pytest.raises(
        ValueError, match="'flow_grpo' trains on denoising_steps; TokenTrainer trains an autoregressive"
    ):
        TokenTrainer(None, get_algorithm("flow_grpo"), TrainConfig(), TokenSampling(), group_size=2)
