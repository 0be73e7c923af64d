"""What an algorithm is: a frozen dataclass of its settings that declares what it needs from a step and computes its
loss from a typed batch.

- ``needs`` (:class:`Needs`): what the trainer and the step core must prepare -- denoising steps, final samples or
  tokens; old-policy log-probs or transition means; a reference forward; an EMA "old" adapter (and whether rollouts
  sample with it); (chosen, rejected) pairs or every sample. Nothing outside algorithms/ compares algorithm names.
- ``loss(batch) -> (loss, metrics)``: the objective of one micro-batch from a batch of algorithms/batches.py. The
  math lives in the pure loss functions (algorithms/losses*.py); the objects call them.

The diffusion algorithms subclass :class:`DiffusionAlgorithm` (the rollout sampler and the group advantages every one
of them has); a token algorithm (algorithms/gspo.py) implements the same :class:`Algorithm` protocol on its own.
Adding an algorithm is one file here and one ``register(...)`` line in algorithms/catalog.py (docs/algorithms.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from diffrl.algorithms.sde import SDE_TYPES
from diffrl.algorithms.windows import WindowPolicy

Metrics = dict[str, torch.Tensor]

# What an algorithm trains on (Needs.data).
DATA = ("denoising_steps", "final_samples", "tokens")


@dataclass(frozen=True)
class Needs:
    """What an algorithm needs from a step; read by the trainer and the step core instead of its name.

    data: "denoising_steps" (replays of the reverse SDE steps in the rollout window, per-step log-probs: StepBatch),
        "final_samples" (the rollout's final latents re-noised by the forward process, so the window must end at
        the last denoising step: SampleBatch) or "tokens" (per-token log-probs of an autoregressive model: TokenBatch).
    old_log_probs: the old (sampling) policy's log-probs: the rollout's, or recomputed with the weights before the
        update when the rollout's numerics differ (TrainConfig.old_log_probs).
    old_means: the old policy's transition means too; always recomputed before the first optimizer step.
    reference: a forward of the reference policy (LoRA off, or a frozen copy of the initial weights).
    teacher: the transition means and velocities of a teacher model (model.teacher) at the stored states, computed
        once per update (data "denoising_steps").
    moving_reference: that reference forward runs the "old" adapter instead (a reference that moves with the policy,
        as ``old_adapter_decay`` updates it); needs reference and old_adapter.
    old_adapter: a second LoRA adapter "old", an EMA of the policy with decay ``old_adapter_decay(updates)`` after
        every update; its prediction is the batch's old-policy prediction.
    samples_with_old_adapter: rollouts sample with that adapter instead of the policy.
    pairs: trains on (chosen, rejected) pairs -- per group the best and the worst valid sample -- instead of every
        valid sample weighted by its advantage.
    groups: trains on whole groups (every valid sample of a prompt) instead of single samples: a micro-batch holds
        whole groups, each group shares its forward-process noise and noise level, and SampleBatch.group_index
        numbers the groups of a micro-batch (data "final_samples").
    reward_gate: the loss gets a per-sample gate, ``algorithm.reward_gate(components)`` of the trained samples'
        reward component scores (StepBatch.kl_gate; data "denoising_steps").
    highest_sigmas: final samples are re-noised only at the sampling schedule's first `highest_sigmas` sigmas, the
        highest noise levels (0 = at any non-zero sigma; data "final_samples").
    varied_groups: trains only on the groups whose rewards differ (DAPO's dynamic sampling: a constant group has
        zero advantages and only dilutes a token-mean loss).
    overlong_shaping: the step's rewards get the algorithm's length penalty before the advantages
        (``algorithm.shape_rewards(rewards, lengths, max_response_length)``: DAPO's overlong reward shaping).
    """

    data: str
    old_log_probs: bool = False
    old_means: bool = False
    reference: bool = False
    teacher: bool = False
    moving_reference: bool = False
    old_adapter: bool = False
    samples_with_old_adapter: bool = False
    pairs: bool = False
    groups: bool = False
    highest_sigmas: int = 0
    reward_gate: bool = False
    varied_groups: bool = False
    overlong_shaping: bool = False

    def __post_init__(self) -> None:
        if self.data not in DATA:
            raise ValueError(f"Needs.data must be one of {DATA}; got {self.data!r}")
        if self.samples_with_old_adapter and not self.old_adapter:
            raise ValueError("Needs.samples_with_old_adapter needs old_adapter: the rollout samples with that adapter")
        if self.old_means and self.data != "denoising_steps":
            raise ValueError("Needs.old_means are transition means of denoising steps (data 'denoising_steps')")
        if self.moving_reference and not (self.reference and self.old_adapter):
            raise ValueError(
                "Needs.moving_reference runs the reference forward on the old adapter: it needs reference "
                "and old_adapter"
            )
        if self.groups and (self.pairs or self.data != "final_samples"):
            raise ValueError("Needs.groups trains on whole groups of final samples (data 'final_samples', not pairs)")
        if self.teacher and self.data != "denoising_steps":
            raise ValueError("Needs.teacher scores the stored denoising steps (data 'denoising_steps')")
        if self.reward_gate and self.data != "denoising_steps":
            raise ValueError("Needs.reward_gate gates a loss on denoising steps (data 'denoising_steps')")
        if self.highest_sigmas < 0 or (self.highest_sigmas and self.data != "final_samples"):
            raise ValueError("Needs.highest_sigmas must be >= 0, and > 0 only for data 'final_samples'")
        if self.overlong_shaping and self.data != "tokens":
            raise ValueError("Needs.overlong_shaping penalises response lengths: it needs data 'tokens'")


class Algorithm(Protocol):
    """The protocol every algorithm implements: a name, the group-advantage settings the advantages stage reads,
    its needs and its loss. Algorithms are frozen dataclasses, so a config overrides any of their fields."""

    name: str
    norm_by_std: bool
    global_std: bool
    adv_eps: float
    adv_std_ddof: int

    @property
    def needs(self) -> Needs: ...

    def loss(self, batch: Any) -> tuple[torch.Tensor, Metrics]: ...


def check_fields(algorithm: Any, *, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """ValueError naming the field for settings that must be > 0 or >= 0."""
    for name in positive:
        if not getattr(algorithm, name) > 0:
            raise ValueError(f"Algorithm.{name} must be > 0; got {getattr(algorithm, name)}")
    for name in non_negative:
        if getattr(algorithm, name) < 0:
            raise ValueError(f"Algorithm.{name} must be >= 0; got {getattr(algorithm, name)}")


def check_advantage_fields(algorithm: Any) -> None:
    """The group-advantage settings (algorithms.advantages.group_advantages) every algorithm has."""
    check_fields(algorithm, positive=("adv_eps",))
    if algorithm.adv_std_ddof not in (0, 1):
        raise ValueError(
            f"Algorithm.adv_std_ddof must be 0 (population std) or 1 (sample std); got {algorithm.adv_std_ddof}"
        )


@dataclass(frozen=True)
class DiffusionAlgorithm:
    """The settings every diffusion algorithm has; a subclass adds its own fields, ``needs`` and ``loss``.

    name: the catalog name of the bundle (algorithms/catalog.py).
    sde_type, noise_level: the rollout sampler (algorithms.sde); noise_level 0 = ODE rollout.
    window: which steps are stochastic, stored and trained (algorithms.windows).
    norm_by_std, global_std, adv_eps, adv_std_ddof: group advantages (algorithms.advantages): divide by the batch's
        (global_std) or each group's std, population (ddof 0) or sample (ddof 1), plus adv_eps.
    """

    # the sampler of the stored rows: fixed on resume (diffrl/configs/changes.py)
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = dict.fromkeys(("name", "sde_type", "noise_level", "window"), "data")

    name: str
    sde_type: str = "sde"
    noise_level: float = 0.7
    window: WindowPolicy = field(default_factory=lambda: WindowPolicy("all_but_last"))
    norm_by_std: bool = True
    global_std: bool = True
    adv_eps: float = 1e-4
    adv_std_ddof: int = 0

    def __post_init__(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"Algorithm.sde_type must be one of {SDE_TYPES}; got {self.sde_type!r}")
        if not isinstance(self.window, WindowPolicy):
            raise ValueError(f"Algorithm.window must be a WindowPolicy; got {type(self.window).__name__}")
        check_fields(self, non_negative=("noise_level",))
        check_advantage_fields(self)

    @property
    def needs(self) -> Needs:
        raise NotImplementedError(f"{type(self).__name__} must declare its needs")

    def loss(self, batch: Any) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError(f"{type(self).__name__} must define its loss")

    def old_adapter_decay(self, update: int) -> float:
        """EMA decay of the "old" adapter after `update` updates (only for algorithms whose needs.old_adapter)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no old adapter (needs.old_adapter is False)")
