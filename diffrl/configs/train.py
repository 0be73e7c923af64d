"""Trainer settings: LoRA or full fine-tuning, optimizer, batching, precision, old-policy handling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

LORA_INITS = ("gaussian", "default")  # peft init_lora_weights: "gaussian", or True for "default"
LR_SCHEDULES = ("constant", "warmup_constant", "warmup_cosine")
PARAM_DTYPES = ("auto", "fp32", "bf16")
LORA_COMPUTE = ("fp32", "base")  # the LoRA branch's matmuls: fp32, or the base's dtype (weights stay fp32)
OLD_LOG_PROBS = ("auto", "recompute")
ROLLOUT_CORRECTIONS = ("off", "tis", "mask")


@dataclass
class TrainConfig:
    """How the policy is trained; one per run (nested in the run config).

    Batching: an optimizer step consumes ``mini_batch_prompts`` prompts x group size samples
    (over all ranks); each forward/backward sees ``micro_batch_size`` samples of one rank.
    ``old_log_probs``: "auto" reuses the rollout's log-probs as the old policy's when the rollout
    ran in this process on this trainer's adapter at the current policy version (same numerics) with weights the
    replay also runs (not ``rollout.weights`` kind merged/fp8 with steps all);
    otherwise (or with "recompute", or whenever ``rollout_correction`` is on) they are recomputed
    with the current weights before the first optimizer step -- except, with "auto", by the token trainer when the
    step is a single pass (``ppo_epochs`` 1 and the step's samples one mini-batch, no dropout): then no optimizer step
    precedes any replay, the replay's own log-probs are the old policy's (the ratio is 1) and no recompute runs.
    ``rollout_correction``: "tis" multiplies each sample's loss by min(exp(old - rollout), is_cap);
    "mask" drops samples whose ratio exp(old - rollout) lies outside [1/rs_threshold, rs_threshold]. A
    direct-preference algorithm (final samples: dpo, diffusion_nft, awm, dgpo) has no ratio and refuses both.
    """

    # the adapter's shape and scale: fixed on resume, and run.init_from must match them (diffrl/configs/changes.py)
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("lora", "lora_rank", "lora_alpha", "lora_targets"), "weights"),
        "lora_init": "data",  # read once, when the adapter is made
    }

    lora: bool = True  # train a LoRA adapter; false: full fine-tuning (with a frozen reference copy)
    lora_rank: int = 32  # the adapter's rank r
    lora_alpha: int = 64  # the adapter's scale is lora_alpha / lora_rank
    lora_init: str = "gaussian"  # peft's init_lora_weights: gaussian | default
    lora_targets: tuple[str, ...] | None = None  # None -> adapter.default_lora_targets
    lr: float = 3e-4  # AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas, each in [0, 1)
    weight_decay: float = 1e-4  # AdamW weight decay
    eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm
    lr_schedule: str = "constant"  # constant | warmup_constant | warmup_cosine
    warmup_steps: int = 0  # optimizer steps of linear warm-up (warmup_* schedules)
    total_steps: int = 0  # optimizer steps of the run; used by warmup_cosine only
    mini_batch_prompts: int = 16  # prompts (x group size samples) per optimizer step, over all ranks
    micro_batch_size: int = 8  # samples per forward/backward on one rank
    ppo_epochs: int = 1  # passes over each step's samples
    shuffle: bool = True  # shuffle the samples before forming mini-batches
    param_dtype: str = "auto"  # auto = the model's loaded dtype (model.dtype) | fp32 | bf16
    lora_compute: str = "fp32"  # fp32 | base: LoRA matmuls in the base's dtype (bf16), fp32 master weights kept
    gradient_checkpointing: bool = False  # recompute activations in the backward (less memory, more compute)
    offload_optimizer: bool = False  # FSDP2 CPUOffloadPolicy (world size > 1 only)
    offload_reference: bool = False  # full fine-tuning: keep the frozen reference copy on CPU
    # auto: reuse the rollout's when the numerics are the trainer's, the token trainer's replay in a single pass (one
    # epoch, one mini-batch), else recompute | recompute: always
    old_log_probs: str = "auto"
    rollout_correction: str = "off"  # off | tis (loss x min(ratio, is_cap)) | mask (drop ratios outside [1/t, t])
    is_cap: float = 2.0  # rollout_correction tis: the cap of the importance ratio
    rs_threshold: float = 2.0  # rollout_correction mask: t, samples with ratio outside [1/t, t] are dropped
    seed: int = 0  # seeds the trainer's random draws (e.g. the mini-batch shuffle)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.lora_targets is not None:
            self.lora_targets = tuple(self.lora_targets)
            if not self.lora_targets:
                raise ValueError("lora_targets must be None (the model's defaults) or a non-empty list of module names")
        _choice("lora_init", self.lora_init, LORA_INITS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("param_dtype", self.param_dtype, PARAM_DTYPES)
        _choice("lora_compute", self.lora_compute, LORA_COMPUTE)
        _choice("old_log_probs", self.old_log_probs, OLD_LOG_PROBS)
        _choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        for name in ("lora_rank", "lora_alpha", "mini_batch_prompts", "micro_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("lr", "eps", "max_grad_norm", "is_cap", "rs_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        if self.rs_threshold <= 1.0:
            raise ValueError(
                f"rs_threshold must be > 1 (samples with ratio in [1/t, t] are kept); got {self.rs_threshold}"
            )
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1); got {self.betas}")
        for name in ("weight_decay", "warmup_steps", "total_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.lr_schedule == "warmup_cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"lr_schedule 'warmup_cosine' needs total_steps > warmup_steps; got total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps}"
            )

    def torch_param_dtype(self, device: torch.device, model_dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype of the denoiser's frozen/compute weights. "auto" = the dtype the model was loaded
        in (model.dtype) when given -- so an fp32 model stays fp32 on a GPU -- else bf16 on cuda, fp32."""
        if self.param_dtype == "auto":
            if model_dtype is not None:
                return model_dtype
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.param_dtype]

    def recompute_old_log_probs(self, same_numerics: bool, single_pass: bool = False) -> bool:
        """Whether the old policy's log-probs must be recomputed (see the class docstring). single_pass: the trainer
        replays every sample once at the old policy's weights (one PPO epoch, one mini-batch, no dropout), so its
        replay's own log-probs are the old policy's (the token trainer, diffrl/engines/train/tokens.py)."""
        if self.old_log_probs == "recompute":
            return True
        return not single_pass and (self.rollout_correction != "off" or not same_numerics)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
