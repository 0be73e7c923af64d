"""Deterministic (probability-flow ODE) solvers for the flow-matching velocity, on a sigma grid.

Legend: B samples; x (B, ...) latents at noise level sigma (1.0 = pure noise, 0 = data); the flow-matching
interpolant is x_sigma = (1 - sigma) x0 + sigma noise and the model's velocity is v = noise - x0, so the data
prediction is x0_hat = x - sigma v and the ODE is dx/dsigma = v.

Solvers (every step moves from sigma_s to sigma_t < sigma_s; the grid is shared by the whole batch):

* ``"euler"``: x_t = x_s + (sigma_t - sigma_s) v_s. First order; this is the engine's default ODE step
  (``algorithms.sde.sde_step`` with noise level 0), and it equals DDIM / DPM-Solver++(1) for this
  parameterisation.
* ``"dpm2m"``: DPM-Solver++(2M), Lu et al., "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
  Probabilistic Models" (arXiv:2211.01095), Algorithm 2 (multistep, data prediction), with alpha = 1 - sigma
  and the half log-SNR lambda = log((1 - sigma) / sigma). MixGRPO-Flash (arXiv:2507.21802) uses DPM-Solver++
  for the ODE steps after the SDE window. With h = lambda_t - lambda_s, the previous grid point u,
  r = (lambda_s - lambda_u) / h and D = x0_s + (x0_s - x0_u) / (2 r), the paper's update
  x_t = (sigma_t / sigma_s) x_s - alpha_t (exp(-h) - 1) D simplifies (alpha_t (1 - exp(-h)) = 1 - sigma_t / sigma_s,
  and its first-order part is exactly the Euler step) to

      x_t = x_s + (sigma_t - sigma_s) v_s + (1 - sigma_t / sigma_s) (x0_s - x0_u) / (2 r).

  The first step (no previous point, or the previous point is sigma = 1 where lambda = -inf) and a step to
  sigma_t = 0 (lambda_t = +inf) are first order, as diffusers' DPMSolverMultistepScheduler does with
  ``final_sigmas_type="zero"`` (``lower_order_final``); tests/algorithms/test_ode.py checks that scheduler's
  output on the same grid.
* ``"ab2"``: the two-step Adams-Bashforth method in sigma with a variable step (Hairer, Norsett & Wanner,
  "Solving Ordinary Differential Equations I", III.1): with h_n = sigma_t - sigma_s and h_{n-1} = sigma_s - sigma_u,
  x_t = x_s + h_n [(1 + h_n / (2 h_{n-1})) v_s - h_n / (2 h_{n-1}) v_u]; the first step is Euler. Unlike dpm2m
  its last step to sigma = 0 is second order too.

Each solver makes one velocity evaluation per step. Math in fp32 (fp64 if x is fp64); the grid coefficients are
Python floats (fp64), computed once per step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

ODE_SOLVERS = ("euler", "dpm2m", "ab2")

VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]  # (x (B, ...), sigma) -> v (B, ...)


def _half_log_snr(sigma: float) -> float:
    """lambda = log((1 - sigma) / sigma) for 0 < sigma < 1."""
    return math.log1p(-sigma) - math.log(sigma)


def ode_step(
    x: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float,
    sigma_next: float,
    *,
    solver: str,
    previous: tuple[float, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One step of ``solver`` from ``sigma`` to ``sigma_next``; ``previous`` is (sigma_u, x_u, v_u), the last grid
    point's sigma, latents and the velocity evaluated there (None on the first step: a first-order step)."""
    if solver not in ODE_SOLVERS:
        raise ValueError(f"solver must be one of {ODE_SOLVERS}; got {solver!r}")
    if not 0.0 <= sigma_next < sigma <= 1.0:
        raise ValueError(f"a step needs 0 <= sigma_next < sigma <= 1; got sigma {sigma}, sigma_next {sigma_next}")
    dtype = torch.float64 if torch.float64 in (x.dtype, velocity.dtype) else torch.float32
    x, v = x.to(dtype), velocity.to(dtype)
    euler = x + (sigma_next - sigma) * v
    if solver == "euler" or previous is None:
        return euler
    sigma_u, x_u, v_u = previous[0], previous[1].to(dtype), previous[2].to(dtype)
    if not sigma < sigma_u <= 1.0:
        raise ValueError(f"the previous grid point must have sigma in ({sigma}, 1]; got {sigma_u}")
    if solver == "ab2":
        ratio = (sigma_next - sigma) / (2.0 * (sigma - sigma_u))  # h_n / (2 h_{n-1})
        return x + (sigma_next - sigma) * ((1.0 + ratio) * v - ratio * v_u)
    if sigma_u >= 1.0 or sigma_next <= 0.0:  # lambda_u = -inf or lambda_t = +inf: DPM-Solver++'s first order
        return euler
    h = _half_log_snr(sigma_next) - _half_log_snr(sigma)
    r = (_half_log_snr(sigma) - _half_log_snr(sigma_u)) / h
    x0_s, x0_u = x - sigma * v, x_u - sigma_u * v_u
    return euler + ((1.0 - sigma_next / sigma) / (2.0 * r)) * (x0_s - x0_u)


def integrate(
    velocity_fn: VelocityFn, x: torch.Tensor, sigmas: list[float], *, solver: str
) -> tuple[torch.Tensor, int]:
    """Integrate dx/dsigma = v from sigmas[0] to sigmas[-1] (decreasing) on that grid; returns (x, evaluations).

    One ``velocity_fn`` call per step (len(sigmas) - 1 in all).
    """
    if len(sigmas) < 2 or any(b >= a for a, b in zip(sigmas, sigmas[1:])):
        raise ValueError(f"sigmas must be a decreasing grid of at least 2 points; got {sigmas}")
    previous: tuple[float, torch.Tensor, torch.Tensor] | None = None
    for sigma, sigma_next in zip(sigmas, sigmas[1:]):
        v = velocity_fn(x, sigma)
        x_next = ode_step(x, v, sigma, sigma_next, solver=solver, previous=previous)
        previous, x = (sigma, x, v), x_next
    return x, len(sigmas) - 1


def grid_indices(start: int, stop: int, evaluations: int) -> list[int]:
    """Indices into a schedule of ``evaluations + 1`` points from ``start`` to ``stop`` (both kept), spread as evenly
    as integers allow: the sub-schedule of the model's own sigmas an ODE segment is integrated on. With
    ``evaluations >= stop - start`` every index is kept (the segment's own steps)."""
    if evaluations < 1 or stop <= start:
        raise ValueError(f"need evaluations >= 1 and stop > start; got {evaluations}, [{start}, {stop})")
    count = min(evaluations, stop - start)
    return [start + round(k * (stop - start) / count) for k in range(count + 1)]
