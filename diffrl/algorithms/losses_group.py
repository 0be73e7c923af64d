"""Group losses: DGPO on final samples, GARDO on denoising steps.

DGPO (Luo, Hu & Tang 2025, arXiv:2510.08425) trains on whole groups of final samples re-noised by the forward process
(x_t = (1 - sigma) x0 + sigma noise, target = noise - x0; a group shares its noise and sigma). GARDO (He et al. 2025,
arXiv:2512.24138) is Flow-GRPO with a KL that only some samples pay. Shapes: velocities, target (b, *S); advantages,
group_index (b,); log-probs (b,); transition means (b, *S); std_dev_t (b, 1, ...) or (b,). Each returns ``(loss,
metrics)`` with detached 0-dim metrics; math in fp32 (fp64 if an input is fp64). Reference, old-policy and rollout
quantities are constants (detached).
"""

from __future__ import annotations

import torch

from diffrl.algorithms.losses_pg import (
    Metrics,
    _check_positive,
    _clipped_surrogate,
    _dtype,
    _mean_over_non_batch,
    _per_sample,
    _prepare,
    _ratio_metrics,
    kl_per_sample,
)


def _matching_error(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(b,) mean over non-batch dims of (v - target)^2 (the denoising score-matching error of a flow model)."""
    return _mean_over_non_batch((velocity - target) ** 2)


def _group_sums(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G,) per-group sums of (b,) values and (G,) group sizes, for dense group indices 0..G-1."""
    groups = int(group_index.max()) + 1
    sums = torch.zeros(groups, dtype=values.dtype, device=values.device).index_add_(0, group_index, values)
    sizes = torch.zeros_like(sums).index_add_(0, group_index, torch.ones_like(values))
    return sums, sizes


def dgpo_loss(
    velocity: torch.Tensor,
    target: torch.Tensor,
    ref_velocity: torch.Tensor,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    old_velocity: torch.Tensor | None = None,
    clip_ratio: float = 0.0,
    kl_velocity: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, Metrics]:
    """DGPO (Luo, Hu & Tang 2025, arXiv:2510.08425; Luo-Yihong/DGPO train_sd3_dgpo.py, Flow-Factory's DGPOTrainer).

    Per sample, e = mean((v - target)^2), e_ref the same for ``ref_velocity``, A = clamp(A, +-adv_clip_max):
      s_g = beta / |g| * sum_{i in g} A_i (sg(e_i) - e_ref_i)      (one value per group g)
      policy = mean_i(sg(sigmoid(s_g(i))) * A_i * e_i)
      loss = policy + kl_coef * mean_i mean((v - v_kl)^2)          (kl_velocity, when kl_coef > 0)
    The group preference loss of the paper is mean_g -log sigmoid(-s_g); ``policy`` has its gradient divided by beta
    (d/de_i of both is sigmoid(s_g) A_i times 1/b and beta/b), as the published code trains it.
    With ``old_velocity`` and clip_ratio > 0, PPO-style clipping of the error: rho = exp(e_old - sg(e)); a sample
    with A > 0 and rho > 1 + clip_ratio, or A <= 0 and rho < 1 - clip_ratio, keeps its value but no gradient.
    |g| counts the group's rows in the batch (the group size when, as the trainer guarantees, groups are whole).
    Metrics: actor/pg_loss (policy), actor/dsm_loss (mean e), actor/ref_dsm_loss, actor/group_weight (mean sigmoid
    over rows), actor/pg_clipfrac, actor/kl_loss.
    """
    _check_positive("beta", beta)
    _check_positive("adv_clip_max", adv_clip_max)
    if not clip_ratio >= 0:
        raise ValueError(f"clip_ratio must be >= 0; got {clip_ratio}")
    dtype = _dtype(velocity, target, ref_velocity)
    v, target = velocity.to(dtype), target.to(dtype).detach()
    for name, t in (("target", target), ("ref_velocity", ref_velocity), ("old_velocity", old_velocity)):
        if t is not None and t.shape != v.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have velocity's shape {tuple(v.shape)}")
    batch = v.shape[0]
    group_index = torch.as_tensor(group_index, device=v.device).reshape(-1).long()
    if group_index.shape[0] != batch or int(group_index.min()) < 0:
        raise ValueError(f"group_index must hold one group number >= 0 per sample (B={batch}); got {group_index}")
    adv = _per_sample(advantages, batch, dtype, "advantages").detach().to(v.device).clamp(-adv_clip_max, adv_clip_max)
    err = _matching_error(v, target)
    with torch.no_grad():
        ref_err = _matching_error(ref_velocity.to(dtype), target)
        sums, sizes = _group_sums(adv * (err - ref_err), group_index)
        weight = torch.sigmoid(beta * sums / sizes.clamp_min(1))[group_index]
        clipped = torch.zeros_like(err, dtype=torch.bool)
        if old_velocity is not None and clip_ratio > 0:
            ratio = torch.exp(_matching_error(old_velocity.to(dtype), target) - err)
            clipped = torch.where(adv > 0, ratio > 1.0 + clip_ratio, ratio < 1.0 - clip_ratio)
    # a clipped sample keeps its error's value but passes no gradient (torch.where, as the published code)
    trained_err = torch.where(clipped, err.detach(), err)
    policy = (weight * adv * trained_err).mean()
    kl = torch.zeros((), dtype=dtype, device=v.device)
    if kl_coef > 0:
        if kl_velocity is None or kl_velocity.shape != v.shape:
            raise ValueError("kl_coef > 0 needs kl_velocity of velocity's shape (the reference policy's velocity)")
        kl = ((v - kl_velocity.to(dtype).detach()) ** 2).mean()
    loss = policy + kl_coef * kl if kl_coef > 0 else policy
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": policy.detach(),
            "actor/dsm_loss": err.mean(),
            "actor/ref_dsm_loss": ref_err.mean(),
            "actor/group_weight": weight.mean(),
            "actor/pg_clipfrac": clipped.to(dtype).mean(),
            "actor/kl_loss": kl.detach(),
        }
    return loss, metrics


def gardo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    clip_ratio: float,
    adv_clip_max: float,
    ref_prev_sample_mean: torch.Tensor | None = None,
    kl_gate: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GARDO's policy loss (He et al. 2025, arXiv:2512.24138; flow_grpo scripts/train_sd3_gardo.py).

    Per sample, A = clamp(A, +-adv_clip_max), r = exp(log_prob - old_log_prob), s = std_dev_t:
      policy_i = (s_i / mean_b s) * max(-A r, -A clip(r, 1 - clip_ratio, 1 + clip_ratio))
      KL_i = mean((mu - mu_ref)^2 / (2 s_i^2))                   (Flow-GRPO's scaled KL)
      loss = mean_b(weights * policy_i) + kl_coef * mean_{i: gate_i} KL_i   (0 when no sample is gated)
    ``kl_gate`` (b,) bool marks the samples that pay the KL (the paper: those whose reward is most uncertain); None
    gates every sample. Metrics: the ratio metrics, actor/pg_loss, actor/kl_loss (the gated mean), actor/kl_gated_frac.
    """
    _check_positive("clip_ratio", clip_ratio)
    _check_positive("adv_clip_max", adv_clip_max)
    log_prob, old_log_prob, advantages, dtype = _prepare(log_prob, old_log_prob, advantages, adv_clip_max)
    batch = log_prob.shape[0]
    std = _per_sample(std_dev_t, batch, dtype, "std_dev_t").to(log_prob.device).detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    # flow_grpo's GARDO script weights each sample's surrogate by its noise scale relative to the batch's mean
    per_sample = (std / std.mean()) * _clipped_surrogate(ratio, advantages, clip_ratio)
    if weights is not None:
        per_sample = per_sample * _per_sample(weights, batch, dtype, "weights").detach()
    policy = per_sample.mean()
    gate = torch.ones(batch, dtype=torch.bool, device=log_prob.device) if kl_gate is None else kl_gate
    gate = torch.as_tensor(gate, device=log_prob.device).reshape(-1).bool()
    if gate.shape[0] != batch:
        raise ValueError(f"kl_gate must hold one flag per sample (B={batch}); got shape {tuple(gate.shape)}")
    kl = torch.zeros((), dtype=dtype, device=log_prob.device)
    if kl_coef > 0 and bool(gate.any()):
        if ref_prev_sample_mean is None or ref_prev_sample_mean.shape != prev_sample_mean.shape:
            raise ValueError("kl_coef > 0 needs ref_prev_sample_mean of prev_sample_mean's shape")
        kl = kl_per_sample(prev_sample_mean.to(dtype), ref_prev_sample_mean, std)[gate].mean()
    loss = policy + kl_coef * kl if kl_coef > 0 else policy
    metrics = _ratio_metrics(ratio, log_ratio, clip_ratio)
    metrics.update(
        {
            "actor/pg_loss": policy.detach(),
            "actor/kl_loss": kl.detach(),
            "actor/kl_gated_frac": gate.to(dtype).mean(),
        }
    )
    return loss, metrics
