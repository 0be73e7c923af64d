"""Losses on an autoregressive model's tokens: the clipped token-level surrogate of GRPO and DAPO, its KL to the
reference, the ways to aggregate token losses (GRPO, DAPO, Dr.GRPO), DAPO's overlong reward shaping and dynamic
sampling filter, and DPO on sequences.

Legend: B sequences, T tokens (padded; ``mask`` is 1 on response tokens, 0 on padding). Log-probs are per token,
(B, T); advantages one per sequence, (B,). Math is fp32 (fp64 if an input is fp64). Old-policy and reference
log-probs, advantages and rollout-correction weights are constants of the update (detached). Metrics are detached
0-dim tensors named as verl names them for language RL (actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, ...).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from diffrl.algorithms.advantages import _as_rewards, _constant_groups, _group_index
from diffrl.algorithms.losses_dp import dpo_loss
from diffrl.algorithms.losses_pg import Metrics, _check_positive, _dtype

# How per-token losses become one number (verl's loss_agg_mode names):
#   token-mean: sum over every response token of the batch / number of those tokens (DAPO, arXiv:2503.14476 eq. 12)
#   seq-mean-token-mean: mean over sequences of each sequence's token mean (GRPO, arXiv:2402.03300 eq. 3)
#   seq-mean-token-sum-norm: sum over every response token / (B * L), L a constant length (Dr.GRPO, arXiv:2503.20783)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_token_shapes(log_probs: torch.Tensor, mask: torch.Tensor, *others: torch.Tensor | None) -> None:
    """ValueError unless log_probs is (B, T) and mask and every other given tensor have its shape."""
    shapes = [tuple(t.shape) for t in (mask, *others) if t is not None]
    if log_probs.ndim != 2 or any(s != tuple(log_probs.shape) for s in shapes):
        raise ValueError(f"per-token tensors must be (B, T) of one shape; got {tuple(log_probs.shape)} and {shapes}")


def aggregate_tokens(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, *, norm_length: int | None = None
) -> torch.Tensor:
    """One scalar from a (B, T) per-token loss over the response tokens (``mask``), by ``aggregation``
    (:data:`AGGREGATIONS`). norm_length: Dr.GRPO's constant L (the generation budget, so every micro-batch divides by
    the same number); None uses T. A sequence without response tokens counts as length 1 in seq-mean-token-mean."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {aggregation!r}")
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if aggregation == "token-mean":
        return masked.sum() / mask.sum().clamp_min(1.0)
    if aggregation == "seq-mean-token-mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)).mean()
    length = per_token.shape[1] if norm_length is None else norm_length
    _check_positive("norm_length", length)
    return masked.sum() / (per_token.shape[0] * length)


def token_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """(B, T) GRPO's per-token KL estimate to the reference (arXiv:2402.03300 eq. 4; Schulman's k3, verl's
    ``low_var_kl`` without its clamp): pi_ref / pi - log(pi_ref / pi) - 1 >= 0, unbiased for KL(pi || pi_ref)."""
    log_ratio = ref_log_probs.detach() - log_probs
    return torch.exp(log_ratio) - log_ratio - 1.0


def token_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    aggregation: str,
    norm_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The token-level clipped surrogate of GRPO (arXiv:2402.03300 eq. 3) and DAPO (arXiv:2503.14476 eq. 8), as a
    loss to minimise.

    Per token: r_it = exp(log_probs_it - old_log_probs_it); l_it = max(-A_i r_it, -A_i clip(r_it, 1 - clip_ratio_low,
    1 + clip_ratio_high)), times weights_it (rollout-correction weights, (B, T), when given); loss = aggregate_tokens(l,
    mask, aggregation). GRPO: clip 0.2 / 0.2, seq-mean-token-mean. DAPO's clip-higher: 0.2 / 0.28, token-mean.
    Metrics over response tokens: actor/pg_loss, actor/pg_clipfrac (r outside the range), actor/pg_clipfrac_higher,
    actor/pg_clipfrac_lower, actor/ppo_kl = mean(-log r), actor/ratio_mean.
    """
    _check_positive("clip_ratio_low", clip_ratio_low)
    _check_positive("clip_ratio_high", clip_ratio_high)
    check_token_shapes(log_probs, mask, old_log_probs, weights)
    dtype = _dtype(log_probs, old_log_probs)
    mask = mask.to(dtype)
    advantages = torch.as_tensor(advantages, dtype=dtype, device=log_probs.device).reshape(-1, 1).detach()
    if advantages.shape[0] != log_probs.shape[0]:
        raise ValueError(f"advantages must hold one value per sequence (B={log_probs.shape[0]})")
    log_ratio = log_probs.to(dtype) - old_log_probs.to(dtype).detach()
    ratio = torch.exp(log_ratio)
    per_token = torch.maximum(
        -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    )
    if weights is not None:
        per_token = per_token * weights.to(dtype).detach()
    loss = aggregate_tokens(per_token, mask, aggregation, norm_length=norm_length)
    with torch.no_grad():
        higher = (ratio > 1.0 + clip_ratio_high).to(dtype)
        lower = (ratio < 1.0 - clip_ratio_low).to(dtype)
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": aggregate_tokens(higher + lower, mask, "token-mean"),
            "actor/pg_clipfrac_higher": aggregate_tokens(higher, mask, "token-mean"),
            "actor/pg_clipfrac_lower": aggregate_tokens(lower, mask, "token-mean"),
            "actor/ppo_kl": aggregate_tokens(-log_ratio, mask, "token-mean"),
            "actor/ratio_mean": aggregate_tokens(ratio, mask, "token-mean"),
        }
    return loss, metrics


def overlong_penalty(
    lengths: torch.Tensor, *, max_response_length: int, overlong_buffer: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13), added to each response's reward; (B,).

    With L_max = max_response_length and L_cache = overlong_buffer: 0 for |y| <= L_max - L_cache, a linear
    ((L_max - L_cache) - |y|) / L_cache inside the buffer, -1 beyond L_max; times penalty_factor (verl's
    ``overlong_buffer.penalty_factor``; the paper's is 1).
    """
    _check_positive("max_response_length", max_response_length)
    _check_positive("overlong_buffer", overlong_buffer)
    if overlong_buffer > max_response_length:
        raise ValueError(f"overlong_buffer ({overlong_buffer}) must be <= max_response_length ({max_response_length})")
    lengths = torch.as_tensor(lengths)
    # integer token counts become fp32; fp64 lengths stay fp64 (the fp64 tests)
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.float32)
    expected = max_response_length - overlong_buffer
    penalty = ((expected - lengths) / overlong_buffer).clamp(-1.0, 0.0)
    return penalty_factor * torch.where(lengths > max_response_length, -torch.ones_like(penalty), penalty)


def nonconstant_groups(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling as a filter (arXiv:2503.14476 eq. 11: 0 < |{o_i correct}| < G): (B,) bool, True for the
    samples of groups whose rewards are not all equal (a constant group has zero advantages and no gradient). The
    rollout keeps sampling groups until enough pass; this function only decides which do."""
    rewards = _as_rewards(rewards)
    index, num_groups = _group_index(group_ids, rewards.shape[0])
    constant = _constant_groups(rewards, index, num_groups)
    return ~constant[index.to(rewards.device)]


def sequence_log_probs(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) log pi(y | x) = sum of the response tokens' log-probs."""
    check_token_shapes(log_probs, mask)
    return (log_probs * mask.to(log_probs.dtype)).sum(dim=1)


def sequence_dpo_loss(
    chosen_log_probs: torch.Tensor,
    rejected_log_probs: torch.Tensor,
    ref_chosen_log_probs: torch.Tensor,
    ref_rejected_log_probs: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, Metrics]:
    """DPO on sequences (Rafailov et al. 2023, arXiv:2305.18290 eq. 7); inputs (P,) sequence log-probs of each pair:
    loss = mean(-log sigmoid(beta ((log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))))).

    It is Diffusion-DPO's loss (losses_dp.dpo_loss: -1/2 beta' ((e_w - ref_w) - (e_l - ref_l))) with the error
    e = -log pi and beta' = 2 beta, so both share one implementation and the same metrics: actor/dpo_loss,
    actor/implicit_acc, rewards/chosen = mean(beta (log pi(y_w) - log pi_ref(y_w))), rewards/rejected,
    rewards/margins.
    """
    _check_positive("beta", beta)
    return dpo_loss(
        -chosen_log_probs, -rejected_log_probs, -ref_chosen_log_probs, -ref_rejected_log_probs, beta=2.0 * beta
    )
