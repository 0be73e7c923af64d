"""Policy-gradient losses on reverse-step log-probs: Flow-GRPO, its KL (latent or velocity space), GRPO-Guard,
Flow-DPPO; and on-policy distillation to a teacher's transitions (DiffusionOPD).

Every loss takes per-sample tensors of one timestep of one micro-batch -- log_prob,
old_log_prob, advantages: (B,); prev_sample_mean, old_prev_sample_mean: (B, ...);
std_dev_t, sqrt_dt: (B, 1, ...), (B,) or scalars -- and returns ``(loss, metrics)``; metric
values are detached 0-dim tensors (no device sync) named as verl and flow_grpo name them. Math is fp32
(fp64 if an input is fp64). ``weights`` are rollout-correction IS/RS weights, (B,), detached
and multiplied into the per-sample loss before the mean.
"""

from __future__ import annotations

import torch

Metrics = dict[str, torch.Tensor]


def _dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_sample(t, batch: int, dtype, name: str) -> torch.Tensor:
    """Scalar, (B,) or (B, 1, ...) with one value per sample -> (B,)."""
    # as_tensor(python float) would round to fp32 first: give the dtype up front.
    t = t.to(dtype) if isinstance(t, torch.Tensor) else torch.as_tensor(t, dtype=dtype)
    if t.numel() == 1:
        return t.reshape(1).expand(batch)
    if t.shape[0] != batch or t[0].numel() != 1:
        raise ValueError(f"{name} must hold one value per sample (B={batch}); got shape {tuple(t.shape)}")
    return t.reshape(batch)


def _mean_over_non_batch(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def _weighted_mean(per_sample: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is not None:
        # Rollout-correction weights are constants of the update, never differentiated.
        per_sample = per_sample * _per_sample(weights, per_sample.shape[0], per_sample.dtype, "weights").detach()
    return per_sample.mean()


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, clip_ratio: float | None) -> Metrics:
    """ppo_kl, ratio mean/std (population, so B = 1 is finite) and clip fractions."""
    with torch.no_grad():
        metrics = {
            "actor/ppo_kl": (-log_ratio).mean(),
            "actor/ratio_mean": ratio.mean(),
            "actor/ratio_std": ratio.std(correction=0),
        }
        if clip_ratio is not None:
            metrics["actor/pg_clipfrac"] = ((ratio - 1.0).abs() > clip_ratio).to(ratio.dtype).mean()
            metrics["actor/pg_clipfrac_higher"] = (ratio - 1.0 > clip_ratio).to(ratio.dtype).mean()
            metrics["actor/pg_clipfrac_lower"] = (1.0 - ratio > clip_ratio).to(ratio.dtype).mean()
    return metrics


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """PPO: per sample max(-A r, -A clip(r, 1 - eps, 1 + eps))."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.maximum(unclipped, clipped)


def _prepare(log_prob, old_log_prob, advantages, adv_clip_max):
    dtype = _dtype(log_prob, old_log_prob, torch.as_tensor(advantages))
    log_prob = log_prob.to(dtype).reshape(-1)
    batch = log_prob.shape[0]
    # old log-probs and advantages come from the rollout: constants of this update.
    old_log_prob = _per_sample(old_log_prob, batch, dtype, "old_log_prob").detach()
    advantages = _per_sample(advantages, batch, dtype, "advantages").detach()
    if adv_clip_max is not None:
        advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    return log_prob, old_log_prob, advantages, dtype


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0; got {value}")


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio: float,
    adv_clip_max: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Flow-GRPO clipped surrogate (Liu et al. 2025, arXiv:2505.05470; flow_grpo train_sd3.py).

    A = clamp(advantages, +-adv_clip_max); r = exp(log_prob - old_log_prob);
    loss = mean(weights * max(-A r, -A clip(r, 1 - clip_ratio, 1 + clip_ratio))).
    Metrics: actor/pg_loss, pg_clipfrac(_higher/_lower), ppo_kl = mean(old - new), ratio_mean,
    ratio_std (population std; verl-omni uses ddof 1, NaN for B = 1).
    """
    _check_positive("clip_ratio", clip_ratio)
    _check_positive("adv_clip_max", adv_clip_max)
    log_prob, old_log_prob, advantages, _ = _prepare(log_prob, old_log_prob, advantages, adv_clip_max)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss = _weighted_mean(_clipped_surrogate(ratio, advantages, clip_ratio), weights)
    metrics = _ratio_metrics(ratio, log_ratio, clip_ratio)
    metrics["actor/pg_loss"] = loss.detach()
    return loss, metrics


def kl_loss(
    prev_sample_mean: torch.Tensor,
    ref_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
) -> torch.Tensor:
    """Flow-GRPO's KL penalty to the reference policy; returns the scalar loss only.

    mean over non-batch dims of (mu - mu_ref)^2 / (2 std_dev_t^2), then mean over the batch.
    This is flow_grpo's scaled form: the exact KL between the two Gaussian transitions of the
    "sde" sampler also divides by dt (its std is std_dev_t * sqrt(-dt)), i.e. exact = this / -dt.
    The reference mean is a constant (detached). The trainer logs it as actor/kl_loss.
    """
    return kl_per_sample(prev_sample_mean, ref_prev_sample_mean, std_dev_t).mean()


def kl_per_sample(
    prev_sample_mean: torch.Tensor, ref_prev_sample_mean: torch.Tensor, std_dev_t: torch.Tensor
) -> torch.Tensor:
    """(b,) Flow-GRPO's scaled KL of each sample (:func:`kl_loss` before its batch mean)."""
    dtype = _dtype(prev_sample_mean, ref_prev_sample_mean)
    mu = prev_sample_mean.to(dtype)
    if ref_prev_sample_mean.shape != mu.shape:
        raise ValueError(
            f"ref_prev_sample_mean {tuple(ref_prev_sample_mean.shape)} must match prev_sample_mean {tuple(mu.shape)}"
        )
    std = torch.as_tensor(std_dev_t, dtype=dtype, device=mu.device)
    if std.ndim == 1 and mu.ndim > 1:
        std = std.reshape(-1, *([1] * (mu.ndim - 1)))
    per_element = (mu - ref_prev_sample_mean.to(dtype).detach()) ** 2 / (2 * std**2)
    return _mean_over_non_batch(per_element)


def velocity_kl_per_sample(velocity: torch.Tensor, ref_velocity: torch.Tensor) -> torch.Tensor:
    """(b,) the KL penalty in velocity space (Flow-Factory's ``kl_type: v-based``): mean over non-batch dims of
    (v - v_ref)^2, the reference velocity a constant (detached).

    For sde_type "sde" the transition means differ by mu - mu_ref = (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
    (v - v_ref) = (1 + eta^2 / 2) dt (v - v_ref), so :func:`kl_per_sample` is this times
    (1 + eta^2 / 2)^2 dt^2 / (2 std_dev_t^2): the latent form weighs each step by its size and noise level, this one
    weighs every step alike.
    """
    dtype = _dtype(velocity, ref_velocity)
    if ref_velocity.shape != velocity.shape:
        raise ValueError(f"ref_velocity {tuple(ref_velocity.shape)} must match velocity {tuple(velocity.shape)}")
    return _mean_over_non_batch((velocity.to(dtype) - ref_velocity.to(dtype).detach()) ** 2)


def _mean_gap(prev_sample_mean, old_prev_sample_mean, dtype) -> torch.Tensor:
    """(B,) mean over non-batch dims of (mu - mu_old)^2, mu_old a constant."""
    if old_prev_sample_mean.shape != prev_sample_mean.shape:
        raise ValueError(
            f"old_prev_sample_mean {tuple(old_prev_sample_mean.shape)} must match prev_sample_mean "
            f"{tuple(prev_sample_mean.shape)}"
        )
    gap = prev_sample_mean.to(dtype) - old_prev_sample_mean.to(dtype).detach()
    return _mean_over_non_batch(gap**2)


def grpo_guard_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    clip_ratio: float,
    adv_clip_max: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GRPO-Guard with RatioNorm (Wang et al. 2025, arXiv:2510.22319), for sde_type "sde".

    Per sample, with s = std_dev_t * sqrt_dt (the transition std of Flow-GRPO's SDE):
      bias = mean((mu - mu_old)^2) / (2 s^2)   -- re-centres the log-ratio, whose mean under the
                                                  old policy is -bias
      r = exp((log_prob - old_log_prob + bias) * s)
      loss = mean(weights * max(-A r, -A clip(r)) / sqrt_dt^2)   -- gradient re-weighting over t

    The bias is one per sample, as the paper describes (and verl-omni's GRPOGuardLoss computes it).
    Deviation: flow_grpo's scripts/train_sd3_GRPO_Guard.py averages it over the whole batch (a mean over
    dims 1.. of a (B,) tensor), so a micro-batch shares one bias: the losses agree only when every sample
    drifts equally, and the gradient with respect to the transition mean differs even then (a shared
    bias spreads each sample's drift over the batch). We follow the paper. s and sqrt_dt are each
    sample's own too (flow_grpo and verl-omni take batch means, equal when the micro-batch shares a
    timestep; ours stays right when it mixes timesteps, as per-sample windows do).
    """
    _check_positive("clip_ratio", clip_ratio)
    _check_positive("adv_clip_max", adv_clip_max)
    log_prob, old_log_prob, advantages, dtype = _prepare(log_prob, old_log_prob, advantages, adv_clip_max)
    batch = log_prob.shape[0]
    std = _per_sample(std_dev_t, batch, dtype, "std_dev_t").to(log_prob.device)
    root_dt = _per_sample(sqrt_dt, batch, dtype, "sqrt_dt").to(log_prob.device)
    scale = std * root_dt
    bias = _mean_gap(prev_sample_mean, old_prev_sample_mean, dtype) / (2 * scale**2)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp((log_ratio + bias) * scale)
    per_sample = _clipped_surrogate(ratio, advantages, clip_ratio) / root_dt**2
    loss = _weighted_mean(per_sample, weights)
    metrics = _ratio_metrics(ratio, log_ratio, clip_ratio)
    metrics["actor/pg_loss"] = loss.detach()
    return loss, metrics


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_dt: torch.Tensor,
    kl_threshold: float,
    adv_clip_max: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Flow-DPPO: an exact-KL trust-region mask instead of the ratio clip (UniRL FlowDPPO).

    KL_i = mean((mu - mu_old)^2) / (2 s^2), s = std_dev_t * sqrt_dt, is the exact per-element
    KL between the old and current Gaussian transitions of sde_type "sde" (for "cps" and
    "dance_sde" std_dev_t is already the transition std: pass sqrt_dt = 1, see
    ``algorithms.sde.transition_std``). A sample is dropped when KL_i > kl_threshold and its
    ratio has moved in the direction the advantage pushes it (r > 1 and A > 0, or r < 1 and
    A < 0); the rest get the plain surrogate -A r. loss = mean(weights * kept * (-A r)).
    ``adv_clip_max`` None (the published default) leaves advantages unclamped.
    Metrics: the ratio metrics plus actor/dppo_kl_mean, actor/dppo_masked_frac,
    actor/dppo_masked_frac_pos, actor/dppo_masked_frac_neg.
    """
    if not kl_threshold >= 0:
        raise ValueError(f"kl_threshold must be >= 0; got {kl_threshold}")
    _check_positive("adv_clip_max", adv_clip_max)
    log_prob, old_log_prob, advantages, dtype = _prepare(log_prob, old_log_prob, advantages, adv_clip_max)
    batch = log_prob.shape[0]
    scale = _per_sample(std_dev_t, batch, dtype, "std_dev_t") * _per_sample(sqrt_dt, batch, dtype, "sqrt_dt")
    kl = _mean_gap(prev_sample_mean, old_prev_sample_mean, dtype) / (2 * scale.to(log_prob.device) ** 2)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        outside = kl > kl_threshold
        masked_pos = outside & (ratio > 1.0) & (advantages > 0)
        masked_neg = outside & (ratio < 1.0) & (advantages < 0)
        keep = ~(masked_pos | masked_neg)
    # torch.where, not a product: a dropped sample with an overflowed ratio must not give inf * 0.
    per_sample = torch.where(keep, -advantages * ratio, torch.zeros_like(ratio))
    loss = _weighted_mean(per_sample, weights)
    metrics = _ratio_metrics(ratio, log_ratio, None)
    metrics.update(
        {
            "actor/pg_loss": loss.detach(),
            "actor/dppo_kl_mean": kl.detach().mean(),
            "actor/dppo_masked_frac": (~keep).to(dtype).mean(),
            "actor/dppo_masked_frac_pos": masked_pos.to(dtype).mean(),
            "actor/dppo_masked_frac_neg": masked_neg.to(dtype).mean(),
        }
    )
    return loss, metrics


def distillation_loss(
    prev_sample_mean: torch.Tensor,
    teacher_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    *,
    velocity: torch.Tensor | None = None,
    teacher_velocity: torch.Tensor | None = None,
    kl_coef: float = 1.0,
    fm_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DiffusionOPD's on-policy distillation on one denoising step (Li et al. 2026, arXiv:2605.15055; verl-omni's
    ``distill_kl`` and ``distill_fm_mse``), the teacher's quantities at the student's own state being constants.

    Per sample: kl = mean((mu - mu_teacher)^2) / (2 std_dev_t^2), the reverse KL between the two Gaussian transitions
    that share the student's std (:func:`kl_per_sample` with the teacher in place of the reference); where std_dev_t
    is 0 (an ODE step) it is the unit-variance surrogate mean((mu - mu_teacher)^2) / 2, as the paper's Eq. 12.
    fm = mean((v - v_teacher)^2), velocity matching. loss = mean(weights * (kl_coef kl + fm_coef fm)).
    Metrics: actor/distill_kl_loss, and actor/distill_fm_mse_loss when fm_coef > 0 (weighted means over the batch).
    """
    dtype = _dtype(prev_sample_mean, teacher_prev_sample_mean)
    std = torch.as_tensor(std_dev_t, dtype=dtype, device=prev_sample_mean.device)
    # an ODE step has no transition noise: divide by 1, not 0 (the unit-variance surrogate)
    kl = kl_per_sample(prev_sample_mean, teacher_prev_sample_mean, torch.where(std == 0, torch.ones_like(std), std))
    per_sample = kl_coef * kl
    metrics = {"actor/distill_kl_loss": _weighted_mean(kl.detach(), weights)}
    if fm_coef > 0:
        if velocity is None or teacher_velocity is None:
            raise ValueError("fm_coef > 0 needs the student's and the teacher's velocities")
        if teacher_velocity.shape != velocity.shape:
            raise ValueError(
                f"teacher_velocity {tuple(teacher_velocity.shape)} must match velocity {tuple(velocity.shape)}"
            )
        gap = velocity.to(dtype) - teacher_velocity.to(dtype).detach()
        fm = _mean_over_non_batch(gap**2)
        per_sample = per_sample + fm_coef * fm
        metrics["actor/distill_fm_mse_loss"] = _weighted_mean(fm.detach(), weights)
    return _weighted_mean(per_sample, weights), metrics
