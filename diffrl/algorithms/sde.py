"""One reverse (denoising) step of a flow-matching model, stochastic or not, with its log-prob.

Shape legend: B = batch; ``latents_B*`` is any (B, ...) layout -- packed tokens (B, L, C),
images (B, C, H, W) or videos (B, C, F, H, W). ``sigma`` is the flow-matching noise level of
the current latents (1.0 = pure noise, x_sigma = (1 - sigma) x0 + sigma * noise) and
``sigma_prev`` the (smaller) level the step moves to, so dt = sigma_prev - sigma < 0.

Three samplers (``sde_type``):

* ``"sde"`` -- Flow-GRPO (Liu et al. 2025, arXiv:2505.05470), the reverse SDE whose marginals
  match the ODE's: std_dev_t = eta * sqrt(sigma / (1 - sigma)),
  mean = x (1 + std^2/(2 sigma) dt) + v (1 + std^2 (1 - sigma)/(2 sigma)) dt,
  x' = mean + std_dev_t * sqrt(-dt) * eps. Where sigma == 1 the denominator 1 - sigma uses
  ``sigma_max`` instead (flow_grpo passes the schedule's sigmas[1]).
* ``"cps"`` -- Coefficients-Preserving Sampling (Wang & Yu 2025, arXiv:2509.05952):
  std = sigma_prev * sin(eta pi / 2), mean = (1 - sigma_prev) x0_hat + sqrt(sigma_prev^2 - std^2)
  x1_hat with x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v; log_prob = -(x' - mean)^2 with
  every constant dropped, as the reference does.
* ``"dance_sde"`` -- DanceGRPO (Xue et al. 2025, arXiv:2505.07818): mean = x + dt v
  - 1/2 eta^2 score dt with score = -(x - (1 - sigma) x0_hat) / sigma^2, std = eta sqrt(sigma -
  sigma_prev).

Deviations from the published code (also in docs/algorithms.md):
* log_prob of "dance_sde" includes the Gaussian normaliser, as DanceGRPO's current ``flux_step`` does
  (older versions dropped it by accident: the ``- log(std) - log(sqrt(2 pi))`` line was a separate statement);
  the normaliser is constant in the parameters, so ratios and gradients are the same either way.
* ``sqrt_dt`` is sqrt(-dt) for every sde_type (as flow_grpo's ``return_sqrt_dt``). The
  standard deviation of x' is std_dev_t * sqrt_dt only for "sde"; for "cps" and "dance_sde"
  it is std_dev_t itself (see :func:`transition_std`).
* A step whose noise level is 0 is the Euler ODE step x + v dt with log_prob 0 (the
  published code would divide by zero there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

SDE_TYPES = ("sde", "cps", "dance_sde")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SDEStep:
    """Result of :func:`sde_step`.

    prev_sample: (B, ...) the latents at sigma_prev (detached input sample when replaying).
    log_prob: (B,) log-density of prev_sample, averaged over all non-batch dims.
    prev_sample_mean: (B, ...) mean of the transition; carries the gradient w.r.t. velocity.
    std_dev_t: (B, 1, ...) the sampler's std coefficient (see module docstring per type).
    sqrt_dt: (B, 1, ...) sqrt(sigma - sigma_prev).
    velocity: (B, ...) the velocity the step was taken with, in the step's dtype (carries its gradient, as the mean
        does; a KL in velocity space and a teacher's velocity term read it).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    sqrt_dt: torch.Tensor
    velocity: torch.Tensor | None = None


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when any input is fp64, else fp32 (bf16/fp16 overflow in the SDE mean)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _per_sample(value, batch: int, ndim: int, dtype, device, name: str) -> torch.Tensor:
    """A python float, 0-dim or (B,) tensor as a (B, 1, ..., 1) tensor broadcastable to latents."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.numel() == 1 and batch != 1:
        t = t.expand(batch)
    if t.numel() != batch:
        raise ValueError(f"{name} must be a float, a 0-dim tensor or a (B,)={batch} tensor; got shape {tuple(t.shape)}")
    return t.reshape(batch, *([1] * (ndim - 1)))


def _draw_noise(shape, generator, dtype, device) -> torch.Tensor:
    """Standard normal noise; one generator per sample draws that sample's noise (shape[1:])."""
    if generator is None:
        return torch.randn(shape, dtype=dtype, device=device)
    if isinstance(generator, torch.Generator):
        # Draw on the generator's device, then move: a CPU generator stays reproducible on GPU.
        return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device).to(device)
    generators = list(generator)
    if len(generators) != shape[0]:
        raise ValueError(f"generator list must hold one generator per sample (B={shape[0]}); got {len(generators)}")
    return torch.stack(
        [torch.randn(shape[1:], generator=g, dtype=dtype, device=g.device).to(device) for g in generators]
    )


def _gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(sample; mean, std^2); 0 where std == 0 (a deterministic step)."""
    stochastic = std > 0
    # Safe std keeps both branches finite, so torch.where has no NaN gradient to leak.
    safe_std = torch.where(stochastic, std, torch.ones_like(std))
    lp = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    return torch.where(stochastic, lp, torch.zeros_like(lp))


def _host(value, dtype: torch.dtype) -> torch.Tensor | None:
    """`value` (a number or a tensor) flattened on the host in `dtype`; None when it lives on a device."""
    if torch.is_tensor(value) and value.device.type != "cpu":
        return None
    return torch.as_tensor(value).to(dtype).reshape(-1)


def check_sigmas(
    sigma, sigma_prev, *, noise_level=0.0, dtype: torch.dtype = torch.float32, needs_sigma_max: bool = False
) -> None:
    """The step's checks of its sigmas, on values given on the host (numbers, CPU tensors) only. Reading device
    values back waits for every kernel queued before it, in a replay the transformer forward that made the velocity,
    so the host could not queue the loss and the backward ahead of the GPU; the rollout and the replay pass device
    sigmas taken from a host schedule they check with this function first (diffrl/engines/rollout/engine.py)."""
    sigma_h, sigma_prev_h = _host(sigma, dtype), _host(sigma_prev, dtype)
    if sigma_h is None or sigma_prev_h is None:
        return
    if bool((sigma_prev_h > sigma_h).any()):
        raise ValueError("sigma_prev must be <= sigma (a reverse step moves towards sigma = 0)")
    eta_h = _host(noise_level, dtype)
    if needs_sigma_max and eta_h is not None and bool(((sigma_h == 1) & (eta_h != 0)).any()):
        raise ValueError(
            "sigma == 1 makes sigma / (1 - sigma) infinite for sde_type='sde': pass sigma_max "
            "(flow_grpo passes the schedule's sigmas[1])"
        )


def _mean_over_non_batch(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def _flow_grpo_coefficients(x, v, sigma, dt, eta, sigma_max):
    """Flow-GRPO's SDE: (std_dev_t, mean). sigma == 1 uses sigma_max in the denominator."""
    at_one = sigma == 1
    if sigma_max is not None:
        sigma_max_t = torch.as_tensor(sigma_max, dtype=sigma.dtype, device=sigma.device)
        denominator = 1 - torch.where(at_one, sigma_max_t, sigma)
    else:
        # Only deterministic (eta == 0) steps sit at sigma == 1 here (sde_step checks host values); any finite value.
        denominator = torch.where(at_one, torch.ones_like(sigma), 1 - sigma)
    std_dev_t = torch.sqrt(sigma / denominator) * eta
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return std_dev_t, mean


def _cps_coefficients(x, v, sigma, sigma_prev, eta):
    """Coefficients-preserving sampling: (std, mean); mean keeps x0/noise coefficients exact."""
    std_dev_t = sigma_prev * torch.sin(eta * (math.pi / 2))
    x0_hat = x - sigma * v
    x1_hat = x + (1 - sigma) * v
    # clamp_min(0): sigma_prev^2 - std^2 >= 0 analytically; rounding can make it -1e-17.
    mean = x0_hat * (1 - sigma_prev) + x1_hat * torch.sqrt((sigma_prev**2 - std_dev_t**2).clamp_min(0))
    return std_dev_t, mean


def _dance_coefficients(x, v, sigma, dt, eta):
    """DanceGRPO's SDE: (std, mean) with the score of the Gaussian path at x."""
    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    std_dev_t = eta * torch.sqrt(-dt)
    return std_dev_t, mean


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_prev,
    *,
    noise_level,
    sde_type: str = "sde",
    noise: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    sigma_max=None,
) -> SDEStep:
    """One reverse step from ``sigma`` to ``sigma_prev`` and the log-prob of the sample it gives.

    Args:
        latents: (B, ...) current latents x at ``sigma``.
        velocity: (B, ...) model velocity v (flow matching: v = noise - x0).
        sigma, sigma_prev: (B,) tensors, 0-dim tensors or floats; sigma_prev < sigma.
        noise_level: eta, a float or (B,) tensor; 0 gives the Euler ODE step (log_prob 0).
        sde_type: "sde" (Flow-GRPO), "cps" or "dance_sde" (DanceGRPO).
        noise: (B, ...) standard normal noise to use instead of drawing it.
        generator: a torch.Generator or a list of B generators (one per sample).
        prev_sample: replay: the stored sample whose log-prob is returned (detached; the
            gradient flows through prev_sample_mean).
        sigma_max: replaces sigma in 1 - sigma where sigma == 1 ("sde" only).

    Returns:
        :class:`SDEStep`, all in fp32 (fp64 if latents or velocity are fp64).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}; got {sde_type!r}")
    if latents.shape != velocity.shape:
        raise ValueError(
            f"latents {tuple(latents.shape)} and velocity {tuple(velocity.shape)} must have the same shape"
        )
    if noise is not None and prev_sample is not None:
        raise ValueError("pass either noise (rollout) or prev_sample (replay), not both")
    dtype = compute_dtype(latents, velocity)
    x, v = latents.to(dtype), velocity.to(dtype)
    batch, ndim, device = x.shape[0], max(x.ndim, 2), x.device
    sigma_b = _per_sample(sigma, batch, ndim, dtype, device, "sigma")
    sigma_prev_b = _per_sample(sigma_prev, batch, ndim, dtype, device, "sigma_prev")
    eta = _per_sample(noise_level, batch, ndim, dtype, device, "noise_level")
    if x.ndim == 1:  # (B,) latents: per-sample scalars, keep the broadcast shape (B,)
        sigma_b, sigma_prev_b, eta = sigma_b.reshape(-1), sigma_prev_b.reshape(-1), eta.reshape(-1)
    check_sigmas(
        sigma, sigma_prev, noise_level=noise_level, dtype=dtype, needs_sigma_max=sde_type == "sde" and sigma_max is None
    )
    dt = sigma_prev_b - sigma_b
    sqrt_dt = torch.sqrt(-dt)

    if sde_type == "sde":
        std_dev_t, mean = _flow_grpo_coefficients(x, v, sigma_b, dt, eta, sigma_max)
        sample_std = std_dev_t * sqrt_dt
    elif sde_type == "cps":
        std_dev_t, mean = _cps_coefficients(x, v, sigma_b, sigma_prev_b, eta)
        sample_std = std_dev_t
    else:
        std_dev_t, mean = _dance_coefficients(x, v, sigma_b, dt, eta)
        sample_std = std_dev_t
    # eta == 0 is exactly the Euler step: the formulas above reduce to it, but say so exactly.
    deterministic = eta == 0
    mean = torch.where(deterministic, x + v * dt, mean)

    if prev_sample is None:
        if noise is None:
            noise = _draw_noise(x.shape, generator, dtype, device)
        elif noise.shape != x.shape:
            raise ValueError(f"noise must have the latents' shape {tuple(x.shape)}; got {tuple(noise.shape)}")
        prev_sample = mean + sample_std * noise.to(device=device, dtype=dtype)
    elif prev_sample.shape != x.shape:
        raise ValueError(f"prev_sample must have the latents' shape {tuple(x.shape)}; got {tuple(prev_sample.shape)}")
    # The sample is data, not a function of the parameters: only the mean carries gradient.
    prev_sample = prev_sample.detach().to(dtype)

    if sde_type == "cps":
        # Flow-CPS drops every constant (and the 1/(2 std^2) scale): -(x' - mean)^2.
        elementwise = -((prev_sample - mean) ** 2)
        elementwise = torch.where(deterministic, torch.zeros_like(elementwise), elementwise)
    else:
        elementwise = _gaussian_log_prob(prev_sample, mean, sample_std.expand_as(mean))
    log_prob = _mean_over_non_batch(elementwise)
    return SDEStep(prev_sample, log_prob, mean, std_dev_t, sqrt_dt, v)


def transition_std(std_dev_t: torch.Tensor, sqrt_dt: torch.Tensor, sde_type: str = "sde") -> torch.Tensor:
    """The standard deviation of x' given x: std_dev_t * sqrt_dt for "sde", std_dev_t otherwise."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}; got {sde_type!r}")
    return std_dev_t * sqrt_dt if sde_type == "sde" else std_dev_t
