"""The typed inputs of an algorithm's loss: one micro-batch, filled by the trainer as the algorithm's needs say.

Tensors of the current policy carry autograd; everything else is a constant of the update (the losses detach it).
Legend: b samples (sequences) of a micro-batch, S the per-sample latent shape, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    """One window step of a micro-batch of denoising trajectories (Needs.data "denoising_steps").

    log_prob: (b,) log-prob of the stored next latent under the current policy (averaged over S).
    old_log_prob: (b,) the same under the old (sampling) policy.
    advantages: (b,) group-normalised advantages.
    prev_sample_mean: (b, *S) the current policy's transition mean.
    std_dev_t, sqrt_dt: the step's noise scale, (b, 1, ...) (algorithms.sde.SDEStep).
    weights: (b,) rollout-correction weights times the trained-step mask, or None.
    old_prev_sample_mean: (b, *S) the old policy's transition mean (Needs.old_means), else None.
    ref_prev_sample_mean: (b, *S) the reference policy's transition mean (Needs.reference), else None.
    kl_gate: (b,) bool, the samples that pay the KL (Needs.reward_gate), else None.
    velocity: (b, *S) the current policy's (guided) velocity of the step, or None.
    ref_velocity: (b, *S) the reference policy's velocity of the step (Needs.reference), else None.
    teacher_prev_sample_mean, teacher_velocity: (b, *S) the teacher's transition mean and velocity at the same state
        (Needs.teacher), else None.
    """

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    sqrt_dt: torch.Tensor
    weights: torch.Tensor | None = None
    old_prev_sample_mean: torch.Tensor | None = None
    ref_prev_sample_mean: torch.Tensor | None = None
    kl_gate: torch.Tensor | None = None
    velocity: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None
    teacher_prev_sample_mean: torch.Tensor | None = None
    teacher_velocity: torch.Tensor | None = None


@dataclass(frozen=True)
class SampleBatch:
    """Final samples re-noised by the forward process (Needs.data "final_samples"):
    x_t = (1 - sigma) x0 + sigma noise, flow-matching target = noise - x0. Rows of a pair algorithm come as chosen,
    rejected, chosen, rejected, ... (a pair shares its noise and sigma).

    velocity: (b, *S) the current policy's conditional velocity at (x_t, sigma).
    target, x_t, x0: (b, *S). sigma: (b,). advantages: (b,).
    old_velocity: (b, *S) the old adapter's velocity (Needs.old_adapter), else None.
    ref_velocity: (b, *S) the reference policy's velocity (Needs.reference), else None.
    group_index: (b,) int64, the group of each row numbered 0.. within the micro-batch (Needs.groups), else None.
    """

    velocity: torch.Tensor
    target: torch.Tensor
    x_t: torch.Tensor
    x0: torch.Tensor
    sigma: torch.Tensor
    advantages: torch.Tensor
    old_velocity: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None
    group_index: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenBatch:
    """Sampled responses of an autoregressive model (Needs.data "tokens").

    log_probs: (b, T) per-token log-probs under the current policy. old_log_probs: (b, T) under the old policy.
    mask: (b, T) 1 for response tokens, 0 for padding (and prompt). advantages: (b,) one per sequence.
    ref_log_probs: (b, T) under the reference policy (Needs.reference), else None.
    weights: (b, T) rollout-correction weights (rollout vs trainer log-probs), else None.
    Rows of a pair algorithm come as chosen, rejected, chosen, rejected, ...
    """

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None = None
    weights: torch.Tensor | None = None
