"""Direct-preference algorithms on final samples: Diffusion-DPO, DiffusionNFT and AWM.

Each trains on a :class:`~diffrl.algorithms.batches.SampleBatch` -- the rollout's final latents x0 re-noised to
x_t = (1 - sigma) x0 + sigma noise, target noise - x0 -- with the math of algorithms/losses_dp.py. Their rollouts are
ODE samples (noise_level 0) and their window defaults to the last denoising step (``final``), whose output is x0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffrl.algorithms.base import DiffusionAlgorithm, Metrics, Needs, check_fields
from diffrl.algorithms.batches import SampleBatch
from diffrl.algorithms.losses_dp import AWM_WEIGHTINGS, awm_loss, diffusion_nft_loss, dpo_loss
from diffrl.algorithms.windows import WindowPolicy


def _final_window() -> WindowPolicy:
    return WindowPolicy("final", size=1)


def matching_error(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(b,) mean squared flow-matching error ||v - (noise - x0)||^2 of each sample."""
    return ((velocity - target) ** 2).flatten(1).mean(1)


@dataclass(frozen=True)
class DiffusionDPO(DiffusionAlgorithm):
    """Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908), flow-matching form
    (:func:`~diffrl.algorithms.losses_dp.dpo_loss`), on (chosen, rejected) pairs: per group the best and the worst
    sample by advantage. Needs the reference policy's velocity.

    beta: the DPO temperature on the difference of matching errors.
    """

    noise_level: float = 0.0
    window: WindowPolicy = field(default_factory=_final_window)
    beta: float = 5000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("beta",))

    @property
    def needs(self) -> Needs:
        return self.with_reference(Needs("final_samples", reference=True, pairs=True))

    def loss(self, batch: SampleBatch) -> tuple[torch.Tensor, Metrics]:
        if batch.ref_velocity is None:
            raise ValueError("Diffusion-DPO needs the reference policy's velocity (SampleBatch.ref_velocity)")
        err = matching_error(batch.velocity, batch.target)
        ref_err = matching_error(batch.ref_velocity, batch.target)
        # rows come chosen, rejected, chosen, ...
        return dpo_loss(err[0::2], err[1::2], ref_err[0::2], ref_err[1::2], beta=self.beta)


@dataclass(frozen=True)
class DiffusionNFT(DiffusionAlgorithm):
    """DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117; :func:`~diffrl.algorithms.losses_dp.diffusion_nft_loss`).
    Its old policy is a second LoRA adapter "old", an EMA of the policy, which also samples the rollouts (as the
    published code does).

    adv_clip_max: advantage clamp (and scale of the optimality probability). mix_beta: the mix between the current
    and the old policy. ref_coef: weight of the velocity-space reference penalty (0 = no reference forward).
    old_policy_decay_ramp, old_policy_decay_max: the EMA decay after `k` updates, min(ramp * k, max).
    reference "ema": the reference penalty's reference is the old adapter itself.
    """

    OLD_ADAPTER_DECAY = "old_policy_decay_ramp and old_policy_decay_max"

    noise_level: float = 0.0
    window: WindowPolicy = field(default_factory=_final_window)
    adv_clip_max: float = 5.0
    mix_beta: float = 1.0
    ref_coef: float = 0.0
    old_policy_decay_ramp: float = 0.0
    old_policy_decay_max: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive=("adv_clip_max", "mix_beta"),
            non_negative=("ref_coef", "old_policy_decay_ramp", "old_policy_decay_max"),
        )

    @property
    def needs(self) -> Needs:
        return self.with_reference(
            Needs("final_samples", reference=self.ref_coef > 0, old_adapter=True, samples_with_old_adapter=True)
        )

    def old_adapter_decay(self, update: int) -> float:
        """EMA decay of the old policy after `update` updates: min(ramp * update, max)."""
        return min(self.old_policy_decay_ramp * update, self.old_policy_decay_max)

    def loss(self, batch: SampleBatch) -> tuple[torch.Tensor, Metrics]:
        if batch.old_velocity is None:
            raise ValueError("DiffusionNFT needs the old adapter's velocity (SampleBatch.old_velocity)")
        return diffusion_nft_loss(
            batch.velocity,
            batch.old_velocity,
            batch.x_t,
            batch.x0,
            batch.sigma,
            batch.advantages,
            adv_clip_max=self.adv_clip_max,
            mix_beta=self.mix_beta,
            ref_velocity=batch.ref_velocity,
            ref_coef=self.ref_coef,
        )


@dataclass(frozen=True)
class AWM(DiffusionAlgorithm):
    """Advantage Weighted Matching (Xue et al. 2025, arXiv:2509.25050; :func:`~diffrl.algorithms.losses_dp.awm_loss`):
    the flow-matching loss of every sample weighted by its clamped advantage.

    adv_clip_max: advantage clamp. ref_coef: weight of the velocity-space reference penalty (0 = no reference
    forward). awm_weighting: the per-timestep weight, "uniform", "t" or "t**2".
    """

    noise_level: float = 0.0
    window: WindowPolicy = field(default_factory=_final_window)
    adv_clip_max: float = 5.0
    ref_coef: float = 0.0
    awm_weighting: str = "uniform"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("adv_clip_max",), non_negative=("ref_coef",))
        if self.awm_weighting not in AWM_WEIGHTINGS:
            raise ValueError(f"Algorithm.awm_weighting must be one of {AWM_WEIGHTINGS}; got {self.awm_weighting!r}")

    @property
    def needs(self) -> Needs:
        return self.with_reference(Needs("final_samples", reference=self.ref_coef > 0))

    def loss(self, batch: SampleBatch) -> tuple[torch.Tensor, Metrics]:
        return awm_loss(
            batch.velocity,
            batch.target,
            batch.sigma,
            batch.advantages,
            adv_clip_max=self.adv_clip_max,
            ref_velocity=batch.ref_velocity,
            ref_coef=self.ref_coef,
            weighting=self.awm_weighting,
        )
