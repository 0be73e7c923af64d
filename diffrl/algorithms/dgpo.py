"""DGPO: Direct Group Preference Optimization (Luo, Hu & Tang 2025, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv:2510.08425).

A DPO-style preference between the better and the worse half of each group, weighted by the advantages, learnt on
final samples re-noised by the forward process: no log-likelihood of a stochastic sampler, so rollouts are ODE
samples. The math is :func:`~diffrl.algorithms.losses_group.dgpo_loss`; this object declares what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffrl.algorithms.base import DiffusionAlgorithm, Metrics, Needs, check_fields
from diffrl.algorithms.batches import SampleBatch
from diffrl.algorithms.losses_group import dgpo_loss
from diffrl.algorithms.windows import WindowPolicy


def _final_window() -> WindowPolicy:
    return WindowPolicy("final", size=1)


@dataclass(frozen=True)
class DGPO(DiffusionAlgorithm):
    """DGPO on whole groups of final samples (Needs.groups: a micro-batch holds whole groups, which share their
    forward-process noise and noise level, as the published ``use_shared_noise``).

    beta: the DPO temperature on the group's advantage-weighted error gap (paper 100).
    adv_clip_max: advantage clamp.
    clip_ratio: PPO-style clip of the matching error against the old policy, an EMA "old" LoRA adapter
        (0 = no clip and no old adapter).
    kl_coef: weight of mean((v - v_ref)^2) to the reference policy (LoRA off).
    ema_reference: the group preference measures the error gap against the old (EMA) adapter instead of the
        reference policy (the published ``use_ema_ref``).
    old_policy_decay_ramp, old_policy_decay_max: the old adapter's EMA decay after `k` updates, min(ramp k, max).
    train_sigma_steps: the timestep clip: re-noise only at the sampling schedule's first this many sigmas, the highest
        noise levels (0 = every non-zero sigma); the authors' ``trunc_steps`` 6 trains step indices 0..6, i.e. 7.

    Deviations from the published code: one noise level per group and PPO epoch, uniform over the allowed sigmas
    (published: ``num_train_timesteps`` 4 of them per sample and update, drawn without replacement); rollouts always
    sample with the policy (published: with the EMA after ``switch_ema_ref`` steps); the old adapter's decay counts
    RL steps (published: optimizer steps); |g| is the group's rows in the batch.
    """

    NO_EMA_REFERENCE = (
        "its group preference measures against the EMA old adapter with ema_reference: true; its KL keeps the "
        "initial weights"
    )

    noise_level: float = 0.0
    window: WindowPolicy = field(default_factory=_final_window)
    beta: float = 100.0
    adv_clip_max: float = 5.0
    clip_ratio: float = 1e-2
    kl_coef: float = 0.02
    ema_reference: bool = False
    old_policy_decay_ramp: float = 0.001
    old_policy_decay_max: float = 0.3
    train_sigma_steps: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive=("beta", "adv_clip_max"),
            non_negative=(
                "clip_ratio",
                "kl_coef",
                "old_policy_decay_ramp",
                "old_policy_decay_max",
                "train_sigma_steps",
            ),
        )
        if self.old_policy_decay_max > 1:
            raise ValueError(f"Algorithm.old_policy_decay_max must be in [0, 1]; got {self.old_policy_decay_max}")

    @property
    def needs(self) -> Needs:
        return Needs(
            "final_samples",
            groups=True,
            highest_sigmas=self.train_sigma_steps,
            reference=self.kl_coef > 0 or not self.ema_reference,
            old_adapter=self.clip_ratio > 0 or self.ema_reference,
        )

    def old_adapter_decay(self, update: int) -> float:
        """EMA decay of the old policy after `update` updates: min(ramp * update, max)."""
        return min(self.old_policy_decay_ramp * update, self.old_policy_decay_max)

    def loss(self, batch: SampleBatch) -> tuple[torch.Tensor, Metrics]:
        if batch.group_index is None:
            raise ValueError("DGPO needs the group of each row (SampleBatch.group_index)")
        preference_ref = batch.old_velocity if self.ema_reference else batch.ref_velocity
        if preference_ref is None:
            which = "old adapter's" if self.ema_reference else "reference policy's"
            raise ValueError(f"DGPO needs the {which} velocity (SampleBatch)")
        return dgpo_loss(
            batch.velocity,
            batch.target,
            preference_ref,
            batch.advantages,
            batch.group_index,
            beta=self.beta,
            adv_clip_max=self.adv_clip_max,
            old_velocity=batch.old_velocity if self.clip_ratio > 0 else None,
            clip_ratio=self.clip_ratio,
            kl_velocity=batch.ref_velocity,
            kl_coef=self.kl_coef,
        )
