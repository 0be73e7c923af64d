"""Policy-gradient algorithms on reverse denoising steps: Flow-GRPO (the flow_grpo, flow_grpo_fast, mix_grpo and
dance_grpo bundles), GRPO-Guard and Flow-DPPO.

Each trains on a :class:`~diffrl.algorithms.batches.StepBatch` (one window step of a micro-batch) with the math of
algorithms/losses_pg.py. ``kl_coef`` > 0 adds a KL to the reference policy, kl_coef * KL, logged as actor/kl_loss (and
makes the trainer run the reference forward): ``kl_space`` "latent" is Flow-GRPO's KL on the transition means
(:func:`~diffrl.algorithms.losses_pg.kl_loss`), "velocity" Flow-Factory's mean (v - v_ref)^2
(:func:`~diffrl.algorithms.losses_pg.velocity_kl_per_sample`). The reference is the initial weights or, with
``reference: ema``, an EMA of the policy (algorithms/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.algorithms.base import DiffusionAlgorithm, Metrics, Needs, check_fields
from diffrl.algorithms.batches import StepBatch
from diffrl.algorithms.losses_pg import (
    flow_dppo_loss,
    flow_grpo_loss,
    grpo_guard_loss,
    kl_loss,
    velocity_kl_per_sample,
)

# Where the KL to the reference is measured (the algorithms' kl_space).
KL_SPACES = ("latent", "velocity")


def check_kl_space(algorithm) -> None:
    """ValueError naming the field for an unknown kl_space, or "velocity" without a KL."""
    if algorithm.kl_space not in KL_SPACES:
        raise ValueError(f"Algorithm.kl_space must be one of {KL_SPACES}; got {algorithm.kl_space!r}")
    if algorithm.kl_space != "latent" and algorithm.kl_coef <= 0:
        raise ValueError(f"Algorithm.kl_space {algorithm.kl_space!r} selects the KL's space: it needs kl_coef > 0")


def with_reference_kl(
    kl_coef: float, batch: StepBatch, loss: torch.Tensor, metrics: Metrics, kl_space: str = "latent"
) -> tuple[torch.Tensor, Metrics]:
    """loss + kl_coef * KL when kl_coef > 0 (the reference's tensors are constants): kl_space "latent" is
    kl_loss(mu, mu_ref, std_dev_t), "velocity" the batch mean of velocity_kl_per_sample(v, v_ref)."""
    if kl_coef <= 0:
        return loss, metrics
    if kl_space == "velocity":
        if batch.velocity is None or batch.ref_velocity is None:
            raise ValueError("kl_space 'velocity' needs the policy's and the reference's velocity (StepBatch)")
        kl = velocity_kl_per_sample(batch.velocity, batch.ref_velocity).mean()
    else:
        if batch.ref_prev_sample_mean is None:
            raise ValueError(
                "kl_coef > 0 needs the reference policy's transition mean (StepBatch.ref_prev_sample_mean)"
            )
        kl = kl_loss(batch.prev_sample_mean, batch.ref_prev_sample_mean.detach(), batch.std_dev_t)
    metrics["actor/kl_loss"] = kl.detach()
    return loss + kl_coef * kl, metrics


def clipped_surrogate(batch: StepBatch, clip_ratio: float, adv_clip_max: float) -> tuple[torch.Tensor, Metrics]:
    """Flow-GRPO's clipped surrogate (:func:`~diffrl.algorithms.losses_pg.flow_grpo_loss`) of a StepBatch."""
    return flow_grpo_loss(
        batch.log_prob,
        batch.old_log_prob,
        batch.advantages,
        clip_ratio=clip_ratio,
        adv_clip_max=adv_clip_max,
        weights=batch.weights,
    )


@dataclass(frozen=True)
class FlowGRPO(DiffusionAlgorithm):
    """Flow-GRPO (Liu et al. 2025, arXiv:2505.05470): the PPO clipped surrogate on per-step log-probs
    (:func:`~diffrl.algorithms.losses_pg.flow_grpo_loss`), plus ``kl_coef`` times the KL to the reference.

    clip_ratio, adv_clip_max: PPO ratio clip and advantage clamp. kl_coef: weight of the KL (0 = no reference).
    kl_space: where the KL is measured, "latent" (transition means) or "velocity".
    """

    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0
    kl_space: str = "latent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("clip_ratio", "adv_clip_max"), non_negative=("kl_coef",))
        check_kl_space(self)

    @property
    def needs(self) -> Needs:
        return self.with_reference(Needs("denoising_steps", old_log_probs=True, reference=self.kl_coef > 0))

    def loss(self, batch: StepBatch) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = clipped_surrogate(batch, self.clip_ratio, self.adv_clip_max)
        return with_reference_kl(self.kl_coef, batch, loss, metrics, self.kl_space)


@dataclass(frozen=True)
class GRPOGuard(DiffusionAlgorithm):
    """GRPO-Guard with RatioNorm (Wang et al. 2025, arXiv:2510.22319) for sde_type "sde": the log-ratio re-centred by
    each sample's drift of the transition mean (:func:`~diffrl.algorithms.losses_pg.grpo_guard_loss`; its docstring
    lists the deviations from flow_grpo's script). Needs the old policy's transition means. kl_coef, kl_space: the KL
    to the reference, as Flow-GRPO's.
    """

    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0
    kl_space: str = "latent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("clip_ratio", "adv_clip_max"), non_negative=("kl_coef",))
        check_kl_space(self)

    @property
    def needs(self) -> Needs:
        needs = Needs("denoising_steps", old_log_probs=True, old_means=True, reference=self.kl_coef > 0)
        return self.with_reference(needs)

    def loss(self, batch: StepBatch) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = grpo_guard_loss(
            batch.log_prob,
            batch.old_log_prob,
            batch.advantages,
            prev_sample_mean=batch.prev_sample_mean,
            old_prev_sample_mean=batch.old_prev_sample_mean,
            std_dev_t=batch.std_dev_t,
            sqrt_dt=batch.sqrt_dt,
            clip_ratio=self.clip_ratio,
            adv_clip_max=self.adv_clip_max,
            weights=batch.weights,
        )
        return with_reference_kl(self.kl_coef, batch, loss, metrics, self.kl_space)


@dataclass(frozen=True)
class FlowDPPO(DiffusionAlgorithm):
    """Flow-DPPO (UniRL FlowDPPO): an exact-KL trust-region mask instead of the ratio clip
    (:func:`~diffrl.algorithms.losses_pg.flow_dppo_loss`). Needs the old policy's transition means.

    kl_threshold: a sample whose per-step KL exceeds it (and whose ratio moved with its advantage) is dropped.
    kl_coef, kl_space: the KL to the reference, as Flow-GRPO's.
    """

    kl_threshold: float = 1e-5
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0
    kl_space: str = "latent"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("adv_clip_max",), non_negative=("kl_threshold", "kl_coef"))
        check_kl_space(self)

    @property
    def needs(self) -> Needs:
        needs = Needs("denoising_steps", old_log_probs=True, old_means=True, reference=self.kl_coef > 0)
        return self.with_reference(needs)

    def loss(self, batch: StepBatch) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = flow_dppo_loss(
            batch.log_prob,
            batch.old_log_prob,
            batch.advantages,
            prev_sample_mean=batch.prev_sample_mean,
            old_prev_sample_mean=batch.old_prev_sample_mean,
            std_dev_t=batch.std_dev_t,
            sqrt_dt=batch.sqrt_dt,
            kl_threshold=self.kl_threshold,
            adv_clip_max=self.adv_clip_max,
            weights=batch.weights,
        )
        return with_reference_kl(self.kl_coef, batch, loss, metrics, self.kl_space)
