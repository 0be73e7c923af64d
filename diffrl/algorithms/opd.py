"""DiffusionOPD: on-policy distillation of a teacher model into the policy on the policy's own samples (Li et al.
2026, "DiffusionOPD: A Unified Perspective of On-Policy Distillation in Diffusion Models", arXiv:2605.15055;
verl-omni's ``distill_kl`` loss, docs/algo/diffusion_opd.md).

The policy samples its trajectories as every denoising-step algorithm does; the teacher (model.teacher, a frozen
denoiser of the same architecture) replays each stored state, and the loss pulls the policy's transition toward the
teacher's: :func:`~diffrl.algorithms.losses_pg.distillation_loss`. Rewards are scored and logged as in any run; they
enter the loss only with ``pg_coef`` > 0 (verl-omni's auxiliary form: the Flow-GRPO surrogate plus the distillation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.algorithms.base import DiffusionAlgorithm, Metrics, Needs, check_fields
from diffrl.algorithms.batches import StepBatch
from diffrl.algorithms.losses_pg import distillation_loss
from diffrl.algorithms.policy_gradient import clipped_surrogate, with_reference_kl


@dataclass(frozen=True)
class DiffusionOPD(DiffusionAlgorithm):
    """DiffusionOPD on denoising steps: distill_coef x the per-step reverse KL to the teacher, plus fm_coef x the
    velocity MSE to the teacher, plus pg_coef x Flow-GRPO's clipped surrogate and kl_coef x the KL to the reference.

    The bundle's defaults are the paper's released single-teacher recipe (ali-vilab/DiffusionOPD config/opd.py): an ODE
    rollout (noise_level 0, where the KL is the unit-variance surrogate), every step but the last trained
    (timestep_fraction 0.99 of 10 steps), distillation only (no reward term, no reference KL).

    distill_coef: weight of the reverse KL to the teacher's transition (verl-omni ``distill_loss_coef``, 1.0).
    fm_coef: weight of velocity matching, mean((v - v_teacher)^2) (verl-omni ``distill_fm_mse``; 0 = off).
    pg_coef: weight of the Flow-GRPO surrogate on the group advantages (0 = pure distillation); needs noise_level > 0
        (an ODE step has no log-prob to ratio).
    clip_ratio, adv_clip_max: the surrogate's ratio clip and advantage clamp. kl_coef: the KL to the reference.

    Deviations: one teacher (the paper routes each prompt's dataset to its own teacher); the policy is the trained
    weights, not an EMA of them (the paper evaluates an EMA with decay 0.9).
    """

    noise_level: float = 0.0
    distill_coef: float = 1.0
    fm_coef: float = 0.0
    pg_coef: float = 0.0
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive=("clip_ratio", "adv_clip_max"),
            non_negative=("distill_coef", "fm_coef", "pg_coef", "kl_coef"),
        )
        if self.distill_coef == 0 and self.fm_coef == 0:
            raise ValueError("Algorithm.distill_coef or Algorithm.fm_coef must be > 0: DiffusionOPD distils a teacher")
        if self.pg_coef > 0 and self.noise_level == 0:
            raise ValueError(
                "Algorithm.pg_coef > 0 needs Algorithm.noise_level > 0: an ODE rollout step has no log-prob for the "
                "policy-gradient ratio"
            )

    @property
    def needs(self) -> Needs:
        return Needs("denoising_steps", old_log_probs=self.pg_coef > 0, reference=self.kl_coef > 0, teacher=True)

    def loss(self, batch: StepBatch) -> tuple[torch.Tensor, Metrics]:
        if batch.teacher_prev_sample_mean is None:
            raise ValueError("DiffusionOPD needs the teacher's transition mean (StepBatch.teacher_prev_sample_mean)")
        loss, metrics = distillation_loss(
            batch.prev_sample_mean,
            batch.teacher_prev_sample_mean,
            batch.std_dev_t,
            velocity=batch.velocity,
            teacher_velocity=batch.teacher_velocity,
            kl_coef=self.distill_coef,
            fm_coef=self.fm_coef,
            weights=batch.weights,
        )
        if self.pg_coef > 0:
            pg, pg_metrics = clipped_surrogate(batch, self.clip_ratio, self.adv_clip_max)
            loss, metrics = loss + self.pg_coef * pg, {**pg_metrics, **metrics}
        return with_reference_kl(self.kl_coef, batch, loss, metrics)
