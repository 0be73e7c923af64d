"""GSPO on tokens: the same algorithm protocol on an autoregressive model's per-token batch (TokenBatch).

Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): GRPO's group advantages and clipped
surrogate, with one importance ratio per sequence -- the length-normalised sequence likelihood ratio -- instead of
one per token. The model side (an autoregressive adapter that samples and replays tokens) is not built yet, so this
algorithm is not in the catalog; it is tested against the closed form (tests/algorithms/test_gspo.py).

Legend: B sequences, T tokens (padded; ``mask`` marks the response tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from diffrl.algorithms.base import Metrics, Needs, check_advantage_fields, check_fields
from diffrl.algorithms.batches import TokenBatch
from diffrl.algorithms.losses_pg import _check_positive, _dtype


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO's objective, as a loss to minimise (arXiv:2507.18071, eqs. 5-7).

    Per sequence i with |y_i| = sum_t mask_it response tokens (at least 1):
      s_i = exp((1 / |y_i|) sum_t mask_it (log_probs_it - old_log_probs_it)) = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)
      l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_ratio_low, 1 + clip_ratio_high))
      loss = mean_i l_i
    log_probs, old_log_probs, mask: (B, T); advantages: (B,). Old log-probs and advantages are constants. Its gradient
    equals GSPO-token's (verl's ``gspo`` policy loss, seq-mean-token-mean) when a sequence's tokens share A_i.
    Metrics: actor/pg_loss, actor/pg_clipfrac (sequences whose s_i lies outside the clip range), actor/ppo_kl =
    mean_i(-log s_i), actor/ratio_mean, actor/ratio_std (population std).
    """
    _check_positive("clip_ratio_low", clip_ratio_low)
    _check_positive("clip_ratio_high", clip_ratio_high)
    if log_probs.ndim != 2 or old_log_probs.shape != log_probs.shape or mask.shape != log_probs.shape:
        raise ValueError(
            f"log_probs, old_log_probs and mask must be (B, T) of one shape; got {tuple(log_probs.shape)}, "
            f"{tuple(old_log_probs.shape)}, {tuple(mask.shape)}"
        )
    dtype = _dtype(log_probs, old_log_probs)
    mask = mask.to(dtype)
    advantages = torch.as_tensor(advantages, dtype=dtype, device=log_probs.device).reshape(-1).detach()
    if advantages.shape[0] != log_probs.shape[0]:
        raise ValueError(f"advantages must hold one value per sequence (B={log_probs.shape[0]})")
    lengths = mask.sum(dim=1).clamp_min(1.0)
    token_log_ratio = (log_probs.to(dtype) - old_log_probs.to(dtype).detach()) * mask
    log_ratio = token_log_ratio.sum(dim=1) / lengths  # (B,) log s_i
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        outside = (ratio > 1.0 + clip_ratio_high) | (ratio < 1.0 - clip_ratio_low)
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": outside.to(dtype).mean(),
            "actor/ppo_kl": (-log_ratio).mean(),
            "actor/ratio_mean": ratio.mean(),
            "actor/ratio_std": ratio.std(correction=0),
        }
    return loss, metrics


@dataclass(frozen=True)
class GSPO:
    """GSPO on an autoregressive model's tokens. Defaults from the paper's section 5.1: clip range 3e-4 below and
    4e-4 above 1, no KL term. Advantages as verl's GRPO estimator: per group, sample std (ddof 1), eps 1e-6.

    Deviation: none in the loss; the paper's sequence-level reward shaping and data filtering are out of scope.
    """

    FIXED_ON_RESUME: ClassVar[dict[str, str]] = {"name": "data"}  # fixed on resume (diffrl/configs/changes.py)

    name: str
    norm_by_std: bool = True
    global_std: bool = False
    adv_eps: float = 1e-6
    adv_std_ddof: int = 1
    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4

    def __post_init__(self) -> None:
        check_advantage_fields(self)
        check_fields(self, positive=("clip_ratio_low", "clip_ratio_high"))

    @property
    def needs(self) -> Needs:
        return Needs("tokens", old_log_probs=True)

    def loss(self, batch: TokenBatch) -> tuple[torch.Tensor, Metrics]:
        return gspo_loss(
            batch.log_probs,
            batch.old_log_probs,
            batch.mask,
            batch.advantages,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
        )
