"""Losses on final samples (forward process): Diffusion-DPO, DiffusionNFT, AWM, and SFT's supervised flow matching.

These train on clean samples x0 re-noised to x_t = (1 - sigma) x0 + sigma * noise, with the
flow-matching target ``target = noise - x0``. Shapes: velocities, x_t, x0, target (B, ...);
sigma, advantages (B,) (sigma may also be (B, 1, ...) or a float). Each returns
``(loss, metrics)`` with detached 0-dim tensor metrics; math in fp32 (fp64 if an input is fp64).
Old-policy and reference predictions are constants (detached).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffrl.algorithms.losses_pg import Metrics, _check_positive, _dtype, _mean_over_non_batch, _per_sample

AWM_WEIGHTINGS = ("uniform", "t", "t**2")


def dpo_loss(
    model_err_w: torch.Tensor,
    model_err_l: torch.Tensor,
    ref_err_w: torch.Tensor,
    ref_err_l: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, Metrics]:
    """Diffusion-DPO (Wallace et al. 2023, arXiv:2311.12908), flow-matching form.

    Inputs are (P,) per-pair mean squared errors ||v - (noise - x0)||^2 of the policy and the
    reference on the chosen (w) and rejected (l) sample, at the same x_t and sigma.
    inside = -1/2 beta ((e_w - ref_w) - (e_l - ref_l)); loss = mean(-logsigmoid(inside)).
    Metrics: actor/dpo_loss, actor/implicit_acc = mean(inside > 0), rewards/chosen =
    mean(-1/2 beta (e_w - ref_w)), rewards/rejected, rewards/margins = chosen - rejected.
    The 1/2 and the sign follow the diffusers DPO example and verl-omni's DPOLoss.
    """
    _check_positive("beta", beta)
    dtype = _dtype(model_err_w, model_err_l, ref_err_w, ref_err_l)
    e_w, e_l = model_err_w.to(dtype).reshape(-1), model_err_l.to(dtype).reshape(-1)
    if e_w.shape != e_l.shape:
        raise ValueError(f"model_err_w {tuple(e_w.shape)} and model_err_l {tuple(e_l.shape)} must match")
    r_w = _per_sample(ref_err_w, e_w.shape[0], dtype, "ref_err_w").detach()
    r_l = _per_sample(ref_err_l, e_w.shape[0], dtype, "ref_err_l").detach()
    chosen = -0.5 * beta * (e_w - r_w)
    rejected = -0.5 * beta * (e_l - r_l)
    inside = chosen - rejected
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        metrics = {
            "actor/dpo_loss": loss.detach(),
            "actor/implicit_acc": (inside > 0).to(dtype).mean(),
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margins": (chosen - rejected).mean(),
        }
    return loss, metrics


def _broadcast(sigma, like: torch.Tensor, dtype) -> torch.Tensor:
    """sigma as (B, 1, ...) broadcastable to ``like``."""
    batch = like.shape[0]
    return _per_sample(sigma, batch, dtype, "sigma").to(like.device).reshape(batch, *([1] * (like.ndim - 1)))


def _self_normalised_error(x0_pred: torch.Tensor, x0: torch.Tensor, weight_min: float) -> torch.Tensor:
    """(B,) mean((x0_pred - x0)^2) / sg(mean|x0_pred - x0|): DiffusionNFT's adaptive weight."""
    with torch.no_grad():
        weight = _mean_over_non_batch((x0_pred - x0).abs()).clamp_min(weight_min)
    return _mean_over_non_batch((x0_pred - x0) ** 2) / weight


def reward_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = clip(clamp(A, +-m) / m / 2 + 1/2, 0, 1)."""
    _check_positive("adv_clip_max", adv_clip_max)
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (advantages / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def diffusion_nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma,
    advantages: torch.Tensor,
    *,
    adv_clip_max: float,
    mix_beta: float = 1.0,
    ref_velocity: torch.Tensor | None = None,
    ref_coef: float = 0.0,
    weight_min: float = 1e-5,
) -> tuple[torch.Tensor, Metrics]:
    """DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117; NVlabs/DiffusionNFT train_nft_sd3.py).

    Implicit policies from the current v and the old policy's v_old (constant), mix beta:
      v+ = beta v + (1 - beta) v_old,   v- = (1 + beta) v_old - beta v
      x0+- = x_t - sigma v+-;  L+- = mean((x0+- - x0)^2) / sg(mean|x0+- - x0|)  (clamped >= weight_min)
      r = clip(A / adv_clip_max / 2 + 1/2, 0, 1)  (A clamped to +-adv_clip_max first)
      loss = mean(adv_clip_max * (r L+ + (1 - r) L-) / beta) + ref_coef * mean((v - v_ref)^2)
    Metrics: actor/pg_loss (the policy part), actor/positive_loss, actor/negative_loss,
    actor/old_deviate = mean((v - v_old)^2), actor/kl_loss (the reference penalty, 0 if none).
    Deviation: the adaptive weight is computed in the input precision, not always in fp64.
    """
    _check_positive("mix_beta", mix_beta)
    dtype = _dtype(velocity, old_velocity, x_t, x0)
    v, x_t, x0 = velocity.to(dtype), x_t.to(dtype), x0.to(dtype)
    v_old = old_velocity.to(dtype).detach()
    for name, t in (("old_velocity", v_old), ("x_t", x_t), ("x0", x0)):
        if t.shape != v.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have velocity's shape {tuple(v.shape)}")
    s = _broadcast(sigma, v, dtype)
    r = reward_probability(_per_sample(advantages, v.shape[0], dtype, "advantages").detach(), adv_clip_max)
    positive = _self_normalised_error(x_t - s * (mix_beta * v + (1 - mix_beta) * v_old), x0, weight_min)
    negative = _self_normalised_error(x_t - s * ((1 + mix_beta) * v_old - mix_beta * v), x0, weight_min)
    policy = (adv_clip_max * (r * positive + (1 - r) * negative) / mix_beta).mean()
    ref_penalty = _reference_penalty(v, ref_velocity, dtype)
    loss = policy + ref_coef * ref_penalty if ref_coef else policy
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": policy.detach(),
            "actor/positive_loss": positive.mean(),
            "actor/negative_loss": negative.mean(),
            "actor/old_deviate": ((v - v_old) ** 2).mean(),
            "actor/kl_loss": ref_penalty.detach(),
        }
    return loss, metrics


def _reference_penalty(v: torch.Tensor, ref_velocity: torch.Tensor | None, dtype) -> torch.Tensor:
    """mean((v - v_ref)^2) over everything; 0 when there is no reference."""
    if ref_velocity is None:
        return torch.zeros((), dtype=dtype, device=v.device)
    if ref_velocity.shape != v.shape:
        raise ValueError(f"ref_velocity {tuple(ref_velocity.shape)} must have velocity's shape {tuple(v.shape)}")
    return ((v - ref_velocity.to(dtype).detach()) ** 2).mean()


def awm_loss(
    velocity: torch.Tensor,
    target: torch.Tensor,
    sigma,
    advantages: torch.Tensor,
    *,
    adv_clip_max: float,
    ref_velocity: torch.Tensor | None = None,
    ref_coef: float = 0.0,
    weighting: str = "uniform",
) -> tuple[torch.Tensor, Metrics]:
    """Advantage Weighted Matching (Xue et al. 2025, arXiv:2509.25050).

    The pretraining flow-matching loss, weighted per sample by its (clamped) advantage:
      l_i = w(sigma_i) mean((v - target)^2),  w = 1 | sigma | sigma^2 (``weighting``)
      loss = mean(clamp(A, +-adv_clip_max) * l_i) + ref_coef * mean((v - v_ref)^2)
    with target = noise - x0 at x_t = (1 - sigma) x0 + sigma noise. Minimising it lowers the
    matching error (raises the likelihood) of above-average samples and raises it for
    below-average ones; the reference penalty keeps the policy near the pretrained model.
    Deviations: no PPO-style ratio clip and no EMA-policy KL (Flow-Factory's stabilisers);
    the Huber-type weightings are not implemented. Metrics: actor/pg_loss, actor/fm_loss
    (mean l_i), actor/kl_loss.
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS}; got {weighting!r}")
    _check_positive("adv_clip_max", adv_clip_max)
    dtype = _dtype(velocity, target)
    v, target = velocity.to(dtype), target.to(dtype).detach()
    if target.shape != v.shape:
        raise ValueError(f"target {tuple(target.shape)} must have velocity's shape {tuple(v.shape)}")
    batch = v.shape[0]
    s = _per_sample(sigma, batch, dtype, "sigma").to(v.device)
    weight = {"uniform": torch.ones_like(s), "t": s, "t**2": s**2}[weighting]
    matching = weight * _mean_over_non_batch((v - target) ** 2)
    adv = _per_sample(advantages, batch, dtype, "advantages").detach().clamp(-adv_clip_max, adv_clip_max)
    policy = (adv.to(v.device) * matching).mean()
    ref_penalty = _reference_penalty(v, ref_velocity, dtype)
    loss = policy + ref_coef * ref_penalty if ref_coef else policy
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": policy.detach(),
            "actor/fm_loss": matching.mean(),
            "actor/kl_loss": ref_penalty.detach(),
        }
    return loss, metrics


def sft_loss(velocity: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Supervised flow matching (Lipman et al. 2023, arXiv:2210.02747; rectified flow as SD3 trains it, Esser et al.
    2024, arXiv:2403.03206): loss = mean_i mean((v_i - target_i)^2), target = noise - x0 at
    x_t = (1 - sigma) x0 + sigma noise, x0 a dataset image's latents. Metrics: actor/fm_loss (the loss).
    """
    dtype = _dtype(velocity, target)
    v, target = velocity.to(dtype), target.to(dtype).detach()
    if target.shape != v.shape:
        raise ValueError(f"target {tuple(target.shape)} must have velocity's shape {tuple(v.shape)}")
    loss = _mean_over_non_batch((v - target) ** 2).mean()
    return loss, {"actor/fm_loss": loss.detach()}
