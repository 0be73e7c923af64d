"""Building the engines of an autoregressive run (an algorithm on tokens): the policy (a causal LM / VLM,
diffrl/models/causal_lm/policy.py, or Janus-Pro's image generation, diffrl/models/janus/policy.py, by the folder's
model_type), the token trainer and the token rollout (`rollout.engine`): "transformers" samples in-process on the
trainer's module (in an asynchronous run on its behaviour copy, diffrl/engines/train/sync.py); "vllm" with a vLLM
server started here from diffrl's vLLM venv (diffrl/engines/vllm_env.py), which takes each new policy version from
the weight-sync stage (a LoRA adapter loaded at run time, or the full weights reloaded in place) and stops with the
run (the step memory closes it, on success, failure and Ctrl-C; a killed run's server stops itself,
diffrl/engines/vllm_launch.py). The rest of a run's engines (prompts, rewards, the trajectory store, the step memory)
are built as for a diffusion run (diffrl/flows/build.py).
"""

from __future__ import annotations

import logging
import os

from diffrl.engines.rollout.tokens import TokenRolloutEngine, TransformersTokenEngine
from diffrl.engines.rollout.vllm_tokens import VllmTokenEngine
from diffrl.engines.rollout.vllm_weights import MEMORY_ROOT, memory_folder, weights_bytes
from diffrl.engines.train.offload import HostOffload
from diffrl.engines.train.sync import behaviour_copy
from diffrl.engines.train.tokens import TokenTrainer
from diffrl.engines.vllm_env import vllm_python
from diffrl.flows.errors import RunFailure
from diffrl.models.causal_lm.policy import CausalLMPolicy
from diffrl.models.janus.policy import JanusImagePolicy, is_janus_folder
from diffrl.models.kind import RANDOM, folder_kind

log = logging.getLogger(__name__)


def check_token_config(cfg) -> None:
    """ValueError for what an autoregressive run cannot do yet, before anything loads."""
    if cfg.cluster.mode != "local":
        raise ValueError(
            f"cluster.mode {cfg.cluster.mode!r}: autoregressive models run their engines in the run's process for "
            "now; use cluster.mode: local"
        )
    if cfg.data.sample_source != "online":
        raise ValueError("data.sample_source 'offline' reads diffusion preference pairs; token runs sample online")
    if cfg.model.compile:
        raise ValueError("model.compile compiles a diffusion denoiser's blocks; set it false for a causal LM")


def check_image_token_config(cfg, janus: bool) -> None:
    """ValueError for a setting Janus image generation (janus=True) or a text policy (False) does not take."""
    if janus and cfg.rollout.engine != "transformers":
        raise ValueError(
            f"rollout.engine {cfg.rollout.engine!r}: Janus image generation samples in-process only; use "
            "rollout.engine: transformers"
        )
    if janus and cfg.run.async_.enabled:
        raise ValueError(
            f"run.async.max_staleness: {cfg.run.async_.max_staleness}: asynchronous token runs sample text with a "
            "causal LM's behaviour copy; Janus image generation is not supported asynchronously yet (use "
            "run.async.max_staleness: 0)"
        )
    if janus and (cfg.rollout.top_p < 1 or cfg.rollout.stop):
        raise ValueError("Janus image generation samples the full distribution: rollout.top_p 1 and no rollout.stop")
    if janus and cfg.algorithm.needs.overlong_shaping:
        raise ValueError(
            f"algorithm.overlong_buffer {cfg.algorithm.overlong_buffer}: every Janus image has the same length (its "
            "image tokens), so length shaping would penalise all of them alike; set algorithm.overlong_buffer=0"
        )
    if not janus and cfg.rollout.guidance_scale is not None:
        raise ValueError(
            f"rollout.guidance_scale {cfg.rollout.guidance_scale}: a causal LM samples without classifier-free "
            "guidance (only diffusion models and Janus image generation take it); leave it unset"
        )


def build_token_model(
    cfg, model_path: str
) -> tuple[CausalLMPolicy | JanusImagePolicy, TokenRolloutEngine, TokenTrainer]:
    """(policy, rollout, trainer) of `model_path`: a local Hugging Face folder loaded from safetensors, or
    `random:<folder>`, its config.json built with random weights on the run's device (benchmarks at real size:
    diffrl/models/causal_lm/realsize.py). A vLLM rollout's server is running when this returns (its `close()` stops
    it); it starts last, once the trainer has its LoRA."""
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
    janus = is_janus_folder(model_path)
    check_image_token_config(cfg, janus)
    if janus:  # responses are image tokens, sampled with CFG; the reward scores the decoded images
        policy = JanusImagePolicy.from_pretrained(
            os.path.abspath(model_path),
            device=device,
            dtype=dtype,
            random_weights=random_weights,
            guidance_scale=cfg.rollout.guidance_scale,
        )
    else:
        policy = CausalLMPolicy.from_pretrained(
            os.path.abspath(model_path), device=device, dtype=dtype, random_weights=random_weights
        )
    trainer = TokenTrainer(
        policy, cfg.algorithm, cfg.train, cfg.sampling, group_size=cfg.rollout.group_size, device=device
    )
    if cfg.rollout.engine == "vllm":
        return policy, start_vllm_engine(cfg, policy, trainer), trainer
    if cfg.run.async_.enabled:  # the rollout samples with its own LoRA tensors while the trainer updates
        rollout = TransformersTokenEngine(behaviour_copy(policy))
        trainer.rollout_copy = rollout.adapter
        return policy, rollout, trainer
    return policy, TransformersTokenEngine(policy), trainer


def start_vllm_engine(cfg, policy: CausalLMPolicy, trainer: TokenTrainer | None = None) -> VllmTokenEngine:
    """The vLLM rollout engine of the run, its server started and serving policy version 0 (the trainer's initial
    weights: the folder's, and a LoRA adapter starts as a no-op). Its adapters or weight folders go to a tmpfs folder
    (`rollout.vllm.weights_in_memory`, when it has room) or <run_dir>/vllm_weights; the server's log to
    <run_dir>/vllm_weights/vllm-server.log. With offload_trainer the trainer's state leaves the device while the
    server is awake."""
    try:
        python = vllm_python()
    except (RuntimeError, TimeoutError, OSError) as e:
        raise RunFailure(
            f"rollout.engine vllm: the vLLM virtualenv could not be made ({type(e).__name__}: {str(e)[-1500:]}). It "
            "is built once (~3 min, ~3.5 GB, needs PyPI) and cached under DIFFRL_VLLM_VENV_ROOT or "
            "~/.cache/diffrl/vllm; or point DIFFRL_VLLM_PYTHON at an interpreter that has vLLM (with "
            "DIFFRL_VLLM_PYTHONPATH for an offline bundle, docs/operations.md section 7); or sample in-process with "
            "rollout.engine: transformers"
        ) from e
    options, on_disk = cfg.rollout.vllm, os.path.join(cfg.run_dir, "vllm_weights")
    folder = None
    if options.weights_in_memory:
        folder = memory_folder(cfg.run.name, weights_bytes(policy.model, options.weight_sync))
        if folder is None:
            log.warning("rollout.vllm.weights_in_memory: %s has no room; weights go to %s", MEMORY_ROOT, on_disk)
    offload = None
    if options.offload_trainer and trainer is not None:
        offload = HostOffload(policy.model, trainer.optimizer)
    engine = VllmTokenEngine(
        policy, options, weights_dir=folder or on_disk, log_dir=on_disk, python=python, trainer_offload=offload
    )
    return engine.start()
