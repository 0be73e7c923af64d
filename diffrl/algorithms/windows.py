"""Which denoising steps are stochastic (SDE, stored) and which of those are trained.

For N denoising steps (step i goes from sigmas[i] to sigmas[i + 1]), a window is W consecutive
steps [start, start + W) of one sample. Steps inside are SDE steps whose latents and log-probs
the rollout stores; every other step is a deterministic Euler ODE step. ``trained`` (B, W)
says which in-window steps enter the loss.

Kinds:
* ``"all_but_last"`` -- Flow-GRPO (arXiv:2505.05470): window [0, N - 1), all trained.
* ``"final"`` -- the last ``size`` steps (final-sample algorithms read the final latent).
* ``"random_start"`` -- Flow-GRPO-Fast: a window of ``size`` steps whose start is uniform in
  [lo, hi) (``start_range``), drawn per sample from that sample's seed.
* ``"mix_random"`` -- MixGRPO (arXiv:2507.21802) "random": one start per global step, uniform
  in [lo, hi), drawn from ``seed + step``; the same for every sample.
* ``"mix_progressive"`` -- MixGRPO "progressive": start = lo + size * (step // iters_per_group),
  clamped to N - size.
* ``"dance_fraction"`` -- DanceGRPO (arXiv:2505.07818): all N steps stochastic; per sample a
  random subset of round(timestep_fraction * N) of them (at least 1) is trained.

Deviations from the published code (also in docs/algorithms.md):
* flow_grpo samples every step with the SDE, including the last one, and only leaves it out of
  training; here the last step is an ODE step (no noise is added that nothing learns from).
* flow_grpo's fast sampler draws ``random.randint(lo, hi - size)`` from Python's global RNG;
  here ``start_range`` names the start range directly and the draw is keyed by the sample seed.
* MixGRPO's progressive schedule can also move by a stride smaller than the window
  (``prog_overlap``); here it slides by ``size``.
* DanceGRPO trains int(fraction * N) steps; here round(fraction * N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WINDOW_KINDS = ("all_but_last", "final", "random_start", "mix_random", "mix_progressive", "dance_fraction")

# Keeps the window draw independent of the noise that the same seed draws in the rollout.
_WINDOW_SALT = 0x5DEECE66D


@dataclass(frozen=True)
class WindowPolicy:
    """How windows are chosen. ``start_range`` is [lo, hi) for window starts; hi None = N - size + 1."""

    kind: str  # which steps are stochastic and trained: the kinds above
    size: int = 2  # steps in a window
    start_range: tuple[int, int | None] = (
        0,
        None,
    )  # [lo, hi) of window starts (random_start, mix_*); hi null: N - size + 1
    iters_per_group: int = 25  # mix_progressive: RL steps before the window moves on by size
    timestep_fraction: float = 0.6  # dance_fraction: the share of steps trained per sample
    seed: int = 0  # mix_random: the start of step k is drawn from seed + k

    def __post_init__(self) -> None:
        if self.kind not in WINDOW_KINDS:
            raise ValueError(f"WindowPolicy.kind must be one of {WINDOW_KINDS}; got {self.kind!r}")
        if self.size < 1:
            raise ValueError(f"WindowPolicy.size must be >= 1; got {self.size}")
        if len(self.start_range) != 2:
            raise ValueError(f"WindowPolicy.start_range must be (lo, hi); got {self.start_range!r}")
        if self.iters_per_group < 1:
            raise ValueError(f"WindowPolicy.iters_per_group must be >= 1; got {self.iters_per_group}")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ValueError(f"WindowPolicy.timestep_fraction must be in (0, 1]; got {self.timestep_fraction}")


@dataclass(frozen=True)
class Windows:
    """starts: (B,) int64; size: W (same for all samples); trained: (B, W) bool."""

    starts: torch.Tensor
    size: int
    trained: torch.Tensor

    def stochastic_mask(self, num_steps: int) -> torch.Tensor:
        """(B, num_steps) bool: True where step i is an SDE step of that sample."""
        steps = torch.arange(num_steps, dtype=torch.int64)
        starts = self.starts.reshape(-1, 1)
        return (steps >= starts) & (steps < starts + self.size)

    def trained_steps(self) -> torch.Tensor:
        """(B, W) int64 absolute step index of every in-window position."""
        return self.starts.reshape(-1, 1) + torch.arange(self.size, dtype=torch.int64)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) % (2**63))


def _start_bounds(policy: WindowPolicy, size: int, num_steps: int) -> tuple[int, int]:
    """Validated [lo, hi) for window starts."""
    lo, hi = policy.start_range
    last_start = num_steps - size  # largest start that keeps the window inside
    hi = last_start + 1 if hi is None else hi
    if not 0 <= lo < hi:
        raise ValueError(f"WindowPolicy.start_range {policy.start_range} is empty or negative: need 0 <= lo < hi")
    if hi - 1 > last_start:
        raise ValueError(
            f"WindowPolicy.start_range {policy.start_range} with size {size} runs past num_steps {num_steps}: "
            f"hi must be <= {last_start + 1}"
        )
    return lo, hi


def _check(policy: WindowPolicy, num_steps: int, seeds: torch.Tensor) -> torch.Tensor:
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    seeds = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1)
    if policy.kind in ("final", "random_start", "mix_random", "mix_progressive") and policy.size > num_steps:
        raise ValueError(f"WindowPolicy.size {policy.size} > num_steps {num_steps}")
    if policy.kind == "all_but_last" and num_steps < 2:
        raise ValueError(f"kind 'all_but_last' needs num_steps >= 2; got {num_steps}")
    return seeds


def sample_windows(policy: WindowPolicy, num_steps: int, seeds: torch.Tensor, step: int) -> Windows:
    """Windows of a batch: deterministic in (policy, num_steps, seeds, step).

    Args:
        policy: the :class:`WindowPolicy`.
        num_steps: N, the number of denoising steps.
        seeds: (B,) int64, one seed per sample (the sample's rollout seed).
        step: the global RL step (MixGRPO strategies).
    """
    seeds = _check(policy, num_steps, seeds)
    batch = seeds.shape[0]
    if policy.kind == "all_but_last":
        size = num_steps - 1
        starts = torch.zeros(batch, dtype=torch.int64)
        return Windows(starts, size, torch.ones(batch, size, dtype=torch.bool))
    if policy.kind == "dance_fraction":
        return _dance_windows(policy, num_steps, seeds)
    size = policy.size
    if policy.kind == "final":
        # the last `size` steps (direct-preference training reads the final sample, latents[:, -1])
        starts = torch.full((batch,), num_steps - size, dtype=torch.int64)
        return Windows(starts, size, torch.ones(batch, size, dtype=torch.bool))
    if policy.kind == "random_start":
        lo, hi = _start_bounds(policy, size, num_steps)
        draws = [
            torch.randint(lo, hi, (1,), generator=_generator(policy.seed * _WINDOW_SALT + int(s) + _WINDOW_SALT))
            for s in seeds.tolist()
        ]
        starts = torch.cat(draws) if draws else torch.zeros(0, dtype=torch.int64)
    elif policy.kind == "mix_random":
        lo, hi = _start_bounds(policy, size, num_steps)
        start = int(torch.randint(lo, hi, (1,), generator=_generator(policy.seed + step)))
        starts = torch.full((batch,), start, dtype=torch.int64)
    else:  # mix_progressive
        lo = policy.start_range[0]
        start = min(lo + size * (step // policy.iters_per_group), num_steps - size)
        starts = torch.full((batch,), start, dtype=torch.int64)
    return Windows(starts.to(torch.int64), size, torch.ones(batch, size, dtype=torch.bool))


def _dance_windows(policy: WindowPolicy, num_steps: int, seeds: torch.Tensor) -> Windows:
    """All steps stochastic; a per-sample random subset of round(fraction * N) is trained."""
    batch = seeds.shape[0]
    num_trained = max(1, min(num_steps, round(policy.timestep_fraction * num_steps)))
    trained = torch.zeros(batch, num_steps, dtype=torch.bool)
    for i, s in enumerate(seeds.tolist()):
        perm = torch.randperm(num_steps, generator=_generator(policy.seed * _WINDOW_SALT + int(s) + _WINDOW_SALT))
        trained[i, perm[:num_trained]] = True
    return Windows(torch.zeros(batch, dtype=torch.int64), num_steps, trained)


def ends_at_last_step(policy: WindowPolicy, num_steps: int) -> bool:
    """Whether every sample's window ends at the last of `num_steps` denoising steps at every RL step, so that its last
    stored latent is the final sample (what final-sample algorithms train on). ``final`` and ``dance_fraction`` always
    do; ``random_start`` / ``mix_random`` when their only start is num_steps - size; ``mix_progressive`` when it starts
    there; ``all_but_last`` never."""
    if policy.kind in ("final", "dance_fraction"):
        return True
    if policy.kind == "all_but_last":
        return False
    last_start = num_steps - policy.size
    lo, hi = policy.start_range
    if policy.kind == "mix_progressive":  # start = min(lo + size * (step // iters_per_group), last_start)
        return lo >= last_start
    hi = last_start + 1 if hi is None else hi
    return lo == last_start and hi == lo + 1
