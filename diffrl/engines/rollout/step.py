"""One denoising step: the adapter's guided velocity followed by the SDE/ODE step with its log-prob.

This is the only code path for both the rollout's step and the trainer's replay, so the two share
their numerics exactly (the old-log-prob recompute can be skipped in-process).

Legend: B samples; latents (B, *S) in the adapter's own layout, fp32.
"""

from __future__ import annotations

from typing import Sequence

import torch

from diffrl.algorithms.sde import SDEStep, sde_step
from diffrl.models.base import Encoding, ModelAdapter, SampleShape


def denoise_step(
    adapter: ModelAdapter,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_prev: torch.Tensor,
    encoding: Encoding,
    negative: Encoding | None,
    *,
    guidance_scale: float,
    shape: SampleShape,
    noise_level: float | torch.Tensor,
    sde_type: str,
    sigma_max: float | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> SDEStep:
    """Step latents (B, *S) from sigma (B,) to sigma_prev (B,) with the adapter's guided velocity.

    Args:
        noise_level: float or (B,) per-sample eta; 0 is the Euler ODE step (log_prob 0).
        sigma_max: replaces sigma in 1 - sigma where sigma == 1 for sde_type "sde" (the schedule's
            sigmas[1], as flow_grpo does).
        generator / noise: where the SDE noise comes from (rollout).
        prev_sample: the stored sample whose log-prob is returned (replay). Autograd is left on:
            the trainer differentiates log_prob and prev_sample_mean w.r.t. the transformer.
    """
    with adapter.attention_context():
        velocity = adapter.velocity(latents, sigma, encoding, negative, guidance_scale=guidance_scale, shape=shape)
    return sde_step(
        latents,
        velocity,
        sigma,
        sigma_prev,
        noise_level=noise_level,
        sde_type=sde_type,
        noise=noise,
        generator=generator,
        prev_sample=prev_sample,
        sigma_max=sigma_max,
    )
