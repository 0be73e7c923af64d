"""Per-step pieces of the update on denoising steps: old-policy recompute, rollout correction, reference policy.

Legend: B samples of the whole step (identical on every rank), b samples of one micro-batch,
W window steps, S the per-sample latent shape. All returned log-probs are fp32 on CPU.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diffrl.configs.train import TrainConfig
from diffrl.engines.train.setup import world
from diffrl.engines.trajectories import Trajectories


@dataclass
class OldPolicy:
    """The old policy's per-step quantities for all B samples (CPU fp32)."""

    log_probs: torch.Tensor  # (B, W)
    means: torch.Tensor | None = None  # (B, W, *S) when the algorithm needs them (Needs.old_means)
    recomputed: bool = False
    velocities: torch.Tensor | None = None  # (B, W, *S) the guided velocities, when asked for (a teacher's)


def rank_rows(rows: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous share of `rows` (every rank gets len(rows) / world rows)."""
    rank, size = world()
    if len(rows) % size:
        raise ValueError(
            f"a batch of {len(rows)} samples cannot be split evenly over {size} ranks; "
            "make mini_batch_prompts x group_size (and the step's sample count) "
            "a multiple of the world size"
        )
    share = len(rows) // size
    return rows[rank * share : (rank + 1) * share]


def all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's (n, ...) tensor in rank order (identity with one process)."""
    _, size = world()
    if size == 1:
        return local
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    parts = [torch.empty_like(local, device=device) for _ in range(size)]
    dist.all_gather(parts, local.to(device))
    return torch.cat([p.cpu() for p in parts])


def active_steps(trained: torch.Tensor) -> list[int]:
    """Window steps trained by at least one of the given samples: (n, W) bool -> sorted list.

    Computed from the whole mini-batch (the same on every rank), so FSDP ranks run the same
    number of forward/backward passes even when their own samples train different steps.
    """
    return trained.any(dim=0).nonzero().flatten().tolist()


def recompute_old_policy(
    traj: Trajectories, replay, cfg: TrainConfig, *, with_means: bool, with_velocities: bool = False
) -> OldPolicy:
    """Old log-probs (and transition means, and velocities) with the current weights, without autograd.

    `replay(sub_traj, j)` -> SDEStep. Each rank recomputes its share; the result is all-gathered.
    """
    rows = rank_rows(torch.arange(len(traj)))
    steps = active_steps(traj.trained)
    log_probs = traj.log_probs.clone()[rows]
    means = torch.zeros(len(rows), traj.window_size, *traj.latents.shape[2:]) if with_means else None
    velocities = torch.zeros(len(rows), traj.window_size, *traj.latents.shape[2:]) if with_velocities else None
    with torch.no_grad():
        for start in range(0, len(rows), cfg.micro_batch_size):
            local = torch.arange(start, min(start + cfg.micro_batch_size, len(rows)))
            sub = traj.select(rows[local])
            for j in steps:
                out = replay(sub, j)
                log_probs[local, j] = out.log_prob.float().cpu()
                if means is not None:
                    means[local, j] = out.prev_sample_mean.float().cpu()
                if velocities is not None:
                    velocities[local, j] = out.velocity.float().cpu()
    return OldPolicy(
        all_gather_rows(log_probs),
        None if means is None else all_gather_rows(means),
        recomputed=True,
        velocities=None if velocities is None else all_gather_rows(velocities),
    )


def correction_weights(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cfg: TrainConfig
) -> torch.Tensor | None:
    """(b,) rollout-correction weights from the recomputed-old vs rollout log-prob ratio, or None when off.

    "tis": min(exp(old - rollout), is_cap) (truncated importance sampling);
    "mask": 1 where exp(old - rollout) is in [1/rs_threshold, rs_threshold], else 0.
    """
    if cfg.rollout_correction == "off":
        return None
    log_ratio = (old_log_prob - rollout_log_prob).float()
    if cfg.rollout_correction == "tis":
        return torch.exp(log_ratio).clamp(max=cfg.is_cap)
    return (log_ratio.abs() <= math.log(cfg.rs_threshold)).float()


def correction_stats(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, cfg: TrainConfig):
    """rollout_corr/ratio_{mean,min,max} of the behaviour ratio exp(old - rollout) over the masked entries (trained
    steps, or response tokens), and rollout_corr/ratio_corrected: the share of them the correction changed (tis: the
    ratio was above is_cap; mask: it was dropped). Nothing when the correction is off."""
    if cfg.rollout_correction == "off":
        return {}
    log_ratio = (old_log_prob - rollout_log_prob).double()[mask.bool()]
    if not log_ratio.numel():
        return {f"rollout_corr/ratio_{k}": 1.0 for k in ("mean", "min", "max")} | {"rollout_corr/ratio_corrected": 0.0}
    ratio = torch.exp(log_ratio)
    if cfg.rollout_correction == "tis":
        corrected = ratio > cfg.is_cap
    else:
        corrected = log_ratio.abs() > math.log(cfg.rs_threshold)
    return {
        "rollout_corr/ratio_mean": float(ratio.mean()),
        "rollout_corr/ratio_min": float(ratio.min()),
        "rollout_corr/ratio_max": float(ratio.max()),
        "rollout_corr/ratio_corrected": float(corrected.double().mean()),
    }


@contextlib.contextmanager
def lora_disabled(transformer):
    """The LoRA reference policy: the same module with its adapters switched off."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


@contextlib.contextmanager
def frozen_denoiser(pipe, module, device, offload: bool):
    """Run the pipeline's denoiser as the frozen `module` (a full-fine-tuning reference, a teacher) without autograd;
    with `offload` the module sleeps on the CPU outside this block and wakes on `device` inside it."""
    with torch.no_grad():
        if offload:
            module.to(device)
        try:
            with swapped_transformer(pipe, module):
                yield
        finally:
            if offload:
                module.to("cpu")


@contextlib.contextmanager
def swapped_transformer(pipe, module):
    """Run the pipeline's denoiser as `module` (the frozen full-fine-tuning reference) for a while."""
    trained = pipe.transformer
    pipe.transformer = module
    try:
        yield
    finally:
        pipe.transformer = trained
