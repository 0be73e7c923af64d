"""Algorithms on an autoregressive model's tokens (TokenBatch): token-level GRPO (and its Dr.GRPO variant), DAPO and
DPO on sequences. GSPO, the sequence-ratio variant, is algorithms/gspo.py.

Their math is in algorithms/losses_token.py; each object holds its published defaults and declares its needs. The
group advantages follow verl's GRPO estimator by default: per group, sample std (ddof 1), eps 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

import torch

from diffrl.algorithms.base import Metrics, Needs, check_advantage_fields, check_fields
from diffrl.algorithms.batches import TokenBatch
from diffrl.algorithms.losses_token import (
    AGGREGATIONS,
    aggregate_tokens,
    nonconstant_groups,
    overlong_penalty,
    sequence_dpo_loss,
    sequence_log_probs,
    token_clip_loss,
    token_kl,
)


@dataclass(frozen=True)
class TokenGRPO:
    """GRPO on tokens (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300 eq. 3): group-normalised advantages, the
    token-level clipped surrogate aggregated per sequence then over sequences, plus kl_coef times the k3 KL to the
    reference (eq. 4; needs the reference forward when > 0).

    clip_ratio_low, clip_ratio_high: the ratio clip below and above 1 (the paper's epsilon 0.2 both sides).
    aggregation: one of losses_token.AGGREGATIONS; "seq-mean-token-sum-norm" with norm_by_std=False is Dr.GRPO
        (Liu et al. 2025, arXiv:2503.20783: no length and no std normalisation), dividing by norm_length.
    norm_length: Dr.GRPO's constant length (set it to the generation budget, max_new_tokens); 0 = the batch's T.
    kl_coef: weight of the KL term.
    Deviations: kl_coef defaults to 0 (the paper uses 0.04; verl's examples 0.001), and the KL is aggregated like the
    surrogate; one gradient step per rollout batch unless the trainer runs more (then old != current log-probs).
    """

    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"name": "data"}  # fixed on resume (diffrl/configs/changes.py)

    name: str
    norm_by_std: bool = True
    global_std: bool = False
    adv_eps: float = 1e-6
    adv_std_ddof: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    aggregation: str = "seq-mean-token-mean"
    norm_length: int = 0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        check_advantage_fields(self)
        check_fields(self, positive=("clip_ratio_low", "clip_ratio_high"), non_negative=("norm_length", "kl_coef"))
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"Algorithm.aggregation must be one of {AGGREGATIONS}; got {self.aggregation!r}")

    @property
    def needs(self) -> Needs:
        return Needs("tokens", old_log_probs=True, reference=self.kl_coef > 0)

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, Metrics]:
        norm_length = self.norm_length or None
        loss, metrics = token_clip_loss(
            batch.log_probs,
            batch.old_log_probs,
            batch.mask,
            batch.advantages,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            aggregation=self.aggregation,
            norm_length=norm_length,
            weights=batch.weights,
        )
        if self.kl_coef <= 0:
            return loss, metrics
        if batch.ref_log_probs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs (TokenBatch.ref_log_probs)")
        kl_per_token = token_kl(batch.log_probs.to(loss.dtype), batch.ref_log_probs.to(loss.dtype))
        kl = aggregate_tokens(kl_per_token, batch.mask, self.aggregation, norm_length=norm_length)
        metrics["actor/kl_loss"] = kl.detach()
        metrics["actor/kl_coef"] = torch.tensor(self.kl_coef, dtype=loss.dtype)
        return loss + self.kl_coef * kl, metrics


@dataclass(frozen=True)
class DAPO(TokenGRPO):
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO with clip-higher (0.2 below, 0.28 above), the token-level loss
    (token-mean), no KL, overlong reward shaping (eq. 13, :meth:`shape_rewards`) and dynamic sampling of groups whose
    rewards differ (eq. 11, :meth:`keep`).

    overlong_buffer: L_cache in tokens (the paper: 4096 of L_max 20480); 0 = no shaping.
    overlong_penalty_factor: scale of the shaping penalty (1 in the paper).
    dynamic_sampling: whether the rollout drops groups of equal rewards (and samples more).
    Deviation: the paper resamples until a batch is full; the step core trains on the groups that pass
    (Needs.varied_groups) and does not sample more, so a step may train on fewer samples than it drew.
    """

    clip_ratio_high: float = 0.28
    aggregation: str = "token-mean"
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    dynamic_sampling: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, non_negative=("overlong_buffer", "overlong_penalty_factor"))

    @property
    def needs(self) -> Needs:
        return Needs(
            "tokens",
            old_log_probs=True,
            reference=self.kl_coef > 0,
            varied_groups=self.dynamic_sampling,
            overlong_shaping=self.overlong_buffer > 0,
        )

    def shape_rewards(self, rewards: torch.Tensor, lengths: torch.Tensor, max_response_length: int) -> torch.Tensor:
        """(B,) rewards plus the overlong penalty of each response length (unchanged when overlong_buffer is 0)."""
        rewards = torch.as_tensor(rewards)
        if self.overlong_buffer == 0:
            return rewards
        penalty = overlong_penalty(
            lengths,
            max_response_length=max_response_length,
            overlong_buffer=self.overlong_buffer,
            penalty_factor=self.overlong_penalty_factor,
        )
        return rewards + penalty.to(rewards.dtype if rewards.is_floating_point() else penalty.dtype)

    def keep(self, rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
        """(B,) bool: the samples to train on (all, when dynamic_sampling is off)."""
        keep = nonconstant_groups(rewards, group_ids)
        return keep if self.dynamic_sampling else torch.ones_like(keep)


@dataclass(frozen=True)
class SequenceDPO:
    """DPO on sequences (Rafailov et al. 2023, arXiv:2305.18290): (chosen, rejected) pairs -- per group the best and
    the worst response by advantage, as the diffusion DPO pairs them -- and the reference policy's log-probs.

    beta: the DPO temperature (0.1, the paper's most used value).
    Deviation: the pairs come from the policy's own samples ranked by reward (online DPO), not a fixed dataset.
    """

    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"name": "data"}  # fixed on resume (diffrl/configs/changes.py)

    name: str
    norm_by_std: bool = True
    global_std: bool = False
    adv_eps: float = 1e-6
    adv_std_ddof: int = 1
    beta: float = 0.1

    def __post_init__(self) -> None:
        check_advantage_fields(self)
        check_fields(self, positive=("beta",))

    @property
    def needs(self) -> Needs:
        return Needs("tokens", reference=True, pairs=True)

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, Metrics]:
        if batch.ref_log_probs is None:
            raise ValueError("sequence DPO needs the reference policy's log-probs (TokenBatch.ref_log_probs)")
        if batch.log_probs.shape[0] % 2:
            raise ValueError(f"sequence DPO takes (chosen, rejected) pairs; got {batch.log_probs.shape[0]} rows")
        seq = sequence_log_probs(batch.log_probs, batch.mask)
        ref = sequence_log_probs(batch.ref_log_probs.to(seq.dtype), batch.mask).detach()
        # rows come chosen, rejected, chosen, ...
        return sequence_dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=self.beta)
