"""Building the engines of an autoregressive run (an algorithm on tokens): the causal LM policy, its in-process
token rollout and the token trainer, all on one module (the rollout samples with the trainer's weights). The rest of
a run's engines (prompts, rewards, the trajectory store, the step memory) are built as for a diffusion run
(diffrl/flows/build.py).
"""

from __future__ import annotations

import os

from diffrl.engines.rollout.tokens import TransformersTokenEngine
from diffrl.engines.train.tokens import TokenTrainer
from diffrl.models.causal_lm import CausalLMPolicy
from diffrl.models.kind import RANDOM, folder_kind


def check_token_config(cfg) -> None:
    """ValueError for what an autoregressive run cannot do yet, before anything loads."""
    if cfg.cluster.mode != "local":
        raise ValueError(
            f"cluster.mode {cfg.cluster.mode!r}: autoregressive models run their engines in the run's process for "
            "now; use cluster.mode: local"
        )
    if cfg.data.sample_source != "online":
        raise ValueError("data.sample_source 'offline' reads diffusion preference pairs; token runs sample online")
    if cfg.rollout.engine != "transformers":  # until the vLLM engine is built here, say so rather than ignore it
        raise ValueError(
            f"rollout.engine {cfg.rollout.engine!r}: diffrl train samples token runs in-process for now "
            "(rollout.engine: transformers); the vLLM engine runs engines-only in benchmarks/vllm_ar.py"
        )
    if cfg.model.compile:
        raise ValueError("model.compile compiles a diffusion denoiser's blocks; set it false for a causal LM")


def build_token_model(cfg, model_path: str) -> tuple[CausalLMPolicy, TransformersTokenEngine, TokenTrainer]:
    """(policy, rollout, trainer) of `model_path`: a local Hugging Face folder loaded from safetensors, or
    `random:<folder>`, its config.json built with random weights on the run's device (benchmarks at real size:
    diffrl/models/thinker_config.py)."""
    random_weights = model_path.startswith(RANDOM)
    model_path = model_path.removeprefix(RANDOM)
    if folder_kind(model_path) != "autoregressive":
        raise ValueError(
            f"model.path {cfg.model.path!r} ({model_path}) is not a Hugging Face causal LM folder (config.json), "
            f"which algorithm {cfg.algorithm.name!r} trains"
        )
    if os.environ.get("DIFFRL_VERBOSE") != "1":  # `diffrl -v` shows transformers' "Loading weights" bar
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    device, dtype = cfg.model.device_and_dtype()
    policy = CausalLMPolicy.from_pretrained(
        os.path.abspath(model_path), device=device, dtype=dtype, random_weights=random_weights
    )
    rollout = TransformersTokenEngine(policy)
    trainer = TokenTrainer(
        policy, cfg.algorithm, cfg.train, cfg.sampling, group_size=cfg.rollout.group_size, device=device
    )
    return policy, rollout, trainer
