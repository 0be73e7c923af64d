"""Named algorithm bundles: one frozen dataclass per consistent set of published defaults.

A config says ``algorithm: mix_grpo`` and gets the whole bundle; any field can be overridden
(``get_algorithm("mix_grpo", noise_level=0.5)``). Adding an algorithm is adding one entry to
``ALGORITHMS`` (and its loss to algorithms.losses); nothing else keeps a list of names.
Where each default comes from is cited in docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from diffrl.algorithms import losses
from diffrl.algorithms.sde import SDE_TYPES
from diffrl.algorithms.windows import WindowPolicy

FAMILIES = ("policy_gradient", "direct_preference")
LOSSES = ("flow_grpo_loss", "grpo_guard_loss", "flow_dppo_loss", "dpo_loss", "diffusion_nft_loss", "awm_loss")


@dataclass(frozen=True)
class Algorithm:
    """Everything that defines an RL algorithm, independent of the model.

    family: "policy_gradient" (trains on reverse-step log-probs) or "direct_preference"
        (trains on final samples re-noised by the forward process).
    sde_type, noise_level: the rollout sampler (algorithms.sde); noise_level 0 = ODE rollout.
    window: which steps are stochastic and trained (algorithms.windows).
    norm_by_std, global_std, adv_eps, adv_std_ddof: group advantages (algorithms.advantages): divide by
        the batch's (global_std) or each group's std, population (ddof 0) or sample (ddof 1), plus adv_eps.
    loss: name of the loss function in algorithms.losses.
    clip_ratio, adv_clip_max: PPO ratio clip and advantage clamp.
    kl_coef: weight of kl_loss to the reference policy (policy_gradient; 0 = no reference).
    kl_threshold: Flow-DPPO trust-region threshold on the exact per-step KL.
    beta: Diffusion-DPO temperature.
    mix_beta: DiffusionNFT mix between current and old policy.
    ref_coef: weight of the velocity-space reference penalty (DiffusionNFT, AWM).
    old_policy_decay_ramp, old_policy_decay_max: DiffusionNFT's old policy is an EMA of the
        policy with decay min(ramp * step, max) (see :func:`old_policy_decay`).
    awm_weighting: AWM's per-timestep weighting ("uniform", "t", "t**2").
    """

    name: str
    family: str = "policy_gradient"
    sde_type: str = "sde"
    noise_level: float = 0.7
    window: WindowPolicy = field(default_factory=lambda: WindowPolicy("all_but_last"))
    norm_by_std: bool = True
    global_std: bool = True
    adv_eps: float = 1e-4
    adv_std_ddof: int = 0
    loss: str = "flow_grpo_loss"
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0
    kl_threshold: float = 1e-5
    beta: float = 5000.0
    mix_beta: float = 1.0
    ref_coef: float = 0.0
    old_policy_decay_ramp: float = 0.0
    old_policy_decay_max: float = 0.0
    awm_weighting: str = "uniform"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"Algorithm.family must be one of {FAMILIES}; got {self.family!r}")
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"Algorithm.sde_type must be one of {SDE_TYPES}; got {self.sde_type!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"Algorithm.loss must be one of {LOSSES}; got {self.loss!r}")
        if not isinstance(self.window, WindowPolicy):
            raise ValueError(f"Algorithm.window must be a WindowPolicy; got {type(self.window).__name__}")
        for name in ("noise_level", "kl_coef", "ref_coef", "old_policy_decay_ramp", "old_policy_decay_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"Algorithm.{name} must be >= 0; got {getattr(self, name)}")
        for name in ("clip_ratio", "adv_clip_max", "adv_eps", "beta", "mix_beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Algorithm.{name} must be > 0; got {getattr(self, name)}")
        if self.adv_std_ddof not in (0, 1):
            raise ValueError(
                f"Algorithm.adv_std_ddof must be 0 (population std) or 1 (sample std); got {self.adv_std_ddof}"
            )


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("flow_grpo", kl_coef=0.04),
        Algorithm(
            "flow_grpo_fast",
            noise_level=0.8,
            window=WindowPolicy("random_start", size=2, start_range=(0, 4)),
            clip_ratio=1e-5,
        ),
        Algorithm(
            "mix_grpo",
            sde_type="dance_sde",
            window=WindowPolicy("mix_progressive", size=4, iters_per_group=25),
        ),
        Algorithm("grpo_guard", loss="grpo_guard_loss", kl_coef=0.04),
        Algorithm(
            "dance_grpo",
            sde_type="dance_sde",
            noise_level=0.3,
            window=WindowPolicy("dance_fraction", timestep_fraction=0.6),
            # DanceGRPO's advantages: (r - mean) / (torch.std + 1e-8) within each group (ddof 1)
            global_std=False,
            adv_std_ddof=1,
            adv_eps=1e-8,
        ),
        Algorithm("flow_dppo", loss="flow_dppo_loss", kl_threshold=1e-5),
        Algorithm(
            "dpo",
            family="direct_preference",
            noise_level=0.0,
            loss="dpo_loss",
            beta=5000.0,
            window=WindowPolicy("final", size=1),
        ),
        Algorithm(
            "diffusion_nft",
            family="direct_preference",
            noise_level=0.0,
            loss="diffusion_nft_loss",
            window=WindowPolicy("final", size=1),
            mix_beta=1.0,
            ref_coef=1e-4,
            old_policy_decay_ramp=0.001,
            old_policy_decay_max=0.5,
        ),
        Algorithm(
            "awm",
            family="direct_preference",
            noise_level=0.0,
            loss="awm_loss",
            ref_coef=0.1,
            window=WindowPolicy("final", size=1),
        ),
    )
}


def get_algorithm(name: str, **overrides) -> Algorithm:
    """The named bundle with ``overrides`` applied (each must be an Algorithm field).

    A ``window`` override may be a WindowPolicy or a dict of WindowPolicy fields, which
    replaces only those fields of the bundle's window.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    valid = [f.name for f in dataclasses.fields(Algorithm)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown Algorithm field(s) {unknown} for {name!r}; valid fields: {valid}")
    if "name" in overrides:
        raise ValueError("Algorithm.name cannot be overridden: it selects the bundle")
    algorithm = ALGORITHMS[name]
    window = overrides.get("window")
    if isinstance(window, dict):
        window_fields = [f.name for f in dataclasses.fields(WindowPolicy)]
        bad = sorted(set(window) - set(window_fields))
        if bad:
            raise ValueError(f"unknown WindowPolicy field(s) {bad}; valid fields: {window_fields}")
        overrides = {**overrides, "window": dataclasses.replace(algorithm.window, **window)}
    return dataclasses.replace(algorithm, **overrides)


def loss_fn(algorithm: Algorithm) -> Callable:
    """The loss function the bundle names, from algorithms.losses."""
    return getattr(losses, algorithm.loss)


def old_policy_decay(algorithm: Algorithm, step: int) -> float:
    """EMA decay of DiffusionNFT's old policy at global step ``step``: min(ramp * step, max)."""
    return min(algorithm.old_policy_decay_ramp * step, algorithm.old_policy_decay_max)
