"""The rollout's ODE shortcuts: the deterministic steps a whole chunk shares, on fewer evaluations.

Legend: b samples of one chunk, N denoising steps, S the per-sample latent shape; latents (b, *S) fp32.

A chunk runs its N steps together, each sample with its own window [start, start + W). Steps before the earliest
start of the chunk (the head) and from the latest window end on (the tail) are Euler ODE steps for every sample of
the chunk: ``SamplingConfig.ode_head`` / ``ode_tail`` integrate such a run of steps with a multistep solver
(algorithms/ode.py) on a sub-schedule of the model's own sigmas (``grid_indices``), one transformer evaluation per
sub-step. The tail changes only the final sample (the reward's input): the stored window latents, sigmas and
log-probs are those of the full schedule. The head changes the latents the windows start from.

Deviation from MixGRPO-Flash (arXiv:2507.21802): its windows are shared by the whole batch; here windows are per
sample (Flow-GRPO-Fast draws a start per sample), so the shortcut covers only the steps that every sample of a
chunk spends outside its window, and a chunk with windows spread over the schedule saves less.
"""

from __future__ import annotations

import torch

from diffrl.algorithms.ode import grid_indices, integrate
from diffrl.configs.rollout import OdeShortcut, SamplingConfig
from diffrl.models.base import Encoding, ModelAdapter, SampleShape


def shortcut_bounds(cfg: SamplingConfig, starts: torch.Tensor, size: int) -> tuple[int, int]:
    """(first, last): the chunk's per-step loop runs steps [first, last); a head shortcut covers [0, first) and a tail
    shortcut [last, N). Both are (0, N) when the shortcuts are off or would not save an evaluation."""
    n = cfg.num_inference_steps
    first, last = 0, n
    earliest, latest_end = int(starts.min()), int(starts.max()) + size
    if cfg.ode_head.on and earliest > cfg.ode_head.evaluations:
        first = earliest
    if cfg.ode_tail.on and n - latest_end > cfg.ode_tail.evaluations:
        last = latest_end
    return first, last


def evaluations_per_chunk(cfg: SamplingConfig, starts: torch.Tensor, size: int) -> int:
    """Transformer evaluations (forwards of the chunk's batch) that one chunk with these window starts makes."""
    first, last = shortcut_bounds(cfg, starts, size)
    head = cfg.ode_head.evaluations if first > 0 else 0
    tail = cfg.ode_tail.evaluations if last < cfg.num_inference_steps else 0
    return head + (last - first) + tail


def run_shortcut(
    adapter: ModelAdapter,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    sigmas_dev: torch.Tensor,
    lo: int,
    hi: int,
    option: OdeShortcut,
    encoding: Encoding,
    negative: Encoding | None,
    guidance_scale: float,
    shape: SampleShape,
) -> torch.Tensor:
    """Integrate latents (b, *S) from sigmas[lo] to sigmas[hi] with ``option.evaluations`` evaluations.

    ``sigmas`` (N + 1,) is the schedule on the host (the solver's coefficients: no device sync), ``sigmas_dev`` the
    same on the adapter's device: the transformer sees each sub-schedule sigma as the per-step loop passes it
    (``sigmas_dev[i].expand(b)``), with the same guidance, encodings and attention context as ``denoise_step``.
    """
    b = latents.shape[0]
    indices = grid_indices(lo, hi, option.evaluations)
    by_sigma = {float(sigmas[i]): i for i in indices}

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        with adapter.attention_context():
            return adapter.velocity(
                x, sigmas_dev[by_sigma[sigma]].expand(b), encoding, negative, guidance_scale=guidance_scale, shape=shape
            )

    out, _ = integrate(velocity, latents, [float(sigmas[i]) for i in indices], solver=option.solver)
    return out.to(torch.float32)
