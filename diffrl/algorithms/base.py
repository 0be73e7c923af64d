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

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from diffrl.algorithms.sde import SDE_TYPES
from diffrl.algorithms.windows import WindowPolicy

Metrics = dict[str, torch.Tensor]

# What an algorithm trains on (Needs.data).
DATA = ("denoising_steps", "final_samples", "tokens")
# The reference policy of a KL or reference penalty (DiffusionAlgorithm.reference).
REFERENCES = ("frozen", "ema")


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
    supervised: trains on the (prompt, image) rows of a dataset (``data.sample_source: offline``), each image's
        latents as x0: no rollout, no reward and no advantages (SFT; data "final_samples").
    draws_sigmas: each re-noised sample's sigma comes from ``algorithm.draw_sigma(generator)`` instead of uniformly
        from the sampling schedule's non-zero sigmas (data "final_samples").
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
    supervised: bool = False
    draws_sigmas: bool = False

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
        if (self.supervised or self.draws_sigmas) and self.data != "final_samples":
            raise ValueError("Needs.supervised and Needs.draws_sigmas re-noise final samples (data 'final_samples')")
        if self.supervised and (self.pairs or self.groups or self.reference or self.old_adapter):
            raise ValueError(
                "Needs.supervised trains on single dataset samples: no pairs, groups, reference or old adapter"
            )
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
    reference: the reference policy of the algorithm's KL or reference penalty: "frozen" (the initial weights: LoRA
        off, or a frozen copy) or "ema" (an exponential moving average of the policy, kept as a second LoRA adapter
        "old" and updated after every RL step; needs lora: true). DiffusionNFT's EMA reference is its old policy.
    reference_decay, reference_decay_ramp: the EMA reference's decay after k RL steps, reference <- decay * reference
        + (1 - decay) * policy: reference_decay, or with a ramp > 0 min(reference_decay_ramp * k, reference_decay).
        In (0, 1] with reference "ema" (DiffusionNFT: 0, its old_policy_decay_* apply), 0 with "frozen".
    """

    # the sampler of the stored rows: fixed on resume (diffrl/configs/changes.py)
    FIXED_ON_RESUME: ClassVar[dict[str, str]] = dict.fromkeys(("name", "sde_type", "noise_level", "window"), "data")
    # An algorithm that keeps an old adapter of its own names the fields of that adapter's decay: its EMA reference is
    # that adapter (reference_decay and reference_decay_ramp stay 0).
    OLD_ADAPTER_DECAY: ClassVar[str] = ""
    # Why reference "ema" does not apply to this algorithm ("" = it does).
    NO_EMA_REFERENCE: ClassVar[str] = ""

    name: str
    sde_type: str = "sde"
    noise_level: float = 0.7
    window: WindowPolicy = field(default_factory=lambda: WindowPolicy("all_but_last"))
    norm_by_std: bool = True
    global_std: bool = True
    adv_eps: float = 1e-4
    adv_std_ddof: int = 0
    reference: str = "frozen"
    reference_decay: float = 0.0
    reference_decay_ramp: float = 0.0

    def __post_init__(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"Algorithm.sde_type must be one of {SDE_TYPES}; got {self.sde_type!r}")
        if not isinstance(self.window, WindowPolicy):
            raise ValueError(f"Algorithm.window must be a WindowPolicy; got {type(self.window).__name__}")
        check_fields(self, non_negative=("noise_level",))
        check_advantage_fields(self)
        check_reference_fields(self)

    @property
    def needs(self) -> Needs:
        raise NotImplementedError(f"{type(self).__name__} must declare its needs")

    def loss(self, batch: Any) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError(f"{type(self).__name__} must define its loss")

    def with_reference(self, needs: Needs) -> Needs:
        """`needs` with the reference the `reference` field selects: "ema" runs the reference forward on the "old"
        adapter. ValueError when the algorithm's settings run no reference forward to move."""
        if self.reference == "frozen":
            return needs
        if not needs.reference:
            raise ValueError(
                f"Algorithm.reference 'ema' moves the reference policy, but {self.name!r} with these settings has no "
                "reference (its KL or reference weight is 0): set that weight > 0, or reference: frozen"
            )
        return dataclasses.replace(needs, moving_reference=True, old_adapter=True)

    def old_adapter_decay(self, update: int) -> float:
        """EMA decay of the "old" adapter after `update` updates (only for algorithms whose needs.old_adapter): the EMA
        reference's (:func:`reference_decay_at`) unless the algorithm keeps an old adapter of its own."""
        if self.reference == "ema":
            return reference_decay_at(update, self.reference_decay, self.reference_decay_ramp)
        raise NotImplementedError(f"{type(self).__name__} keeps no old adapter (needs.old_adapter is False)")


def reference_decay_at(update: int, decay: float, ramp: float = 0.0) -> float:
    """The EMA reference's decay after `update` updates: `decay`, or with ramp > 0 min(ramp * update, decay) (a linear
    warm-up from a reference that follows the policy to one that lags it; Flow-Factory's "piecewise_linear" schedule
    with no flat phase). The reference after the update is decay * reference + (1 - decay) * policy."""
    return decay if ramp == 0 else min(ramp * update, decay)


def check_reference_fields(algorithm: DiffusionAlgorithm) -> None:
    """ValueError naming the field for a reference setting that is unknown, out of range or has no effect."""
    if algorithm.reference not in REFERENCES:
        raise ValueError(f"Algorithm.reference must be one of {REFERENCES}; got {algorithm.reference!r}")
    check_fields(algorithm, non_negative=("reference_decay", "reference_decay_ramp"))
    if algorithm.reference_decay > 1:
        raise ValueError(f"Algorithm.reference_decay must be in [0, 1]; got {algorithm.reference_decay}")
    decay_set = algorithm.reference_decay > 0 or algorithm.reference_decay_ramp > 0
    if algorithm.reference == "frozen":
        if decay_set:
            raise ValueError("Algorithm.reference_decay and reference_decay_ramp apply only with reference: ema")
        return
    if algorithm.NO_EMA_REFERENCE:
        raise ValueError(
            f"Algorithm.reference 'ema' does not apply to {algorithm.name!r}: {algorithm.NO_EMA_REFERENCE}"
        )
    if algorithm.OLD_ADAPTER_DECAY and decay_set:
        raise ValueError(
            f"Algorithm.reference 'ema' of {algorithm.name!r} is its old adapter, whose decay "
            f"{algorithm.OLD_ADAPTER_DECAY} set: leave reference_decay and reference_decay_ramp at 0"
        )
    if not algorithm.OLD_ADAPTER_DECAY and algorithm.reference_decay == 0:
        raise ValueError(
            "Algorithm.reference_decay must be in (0, 1] with reference: ema (0 would copy the policy after every "
            "update); Flow-Factory's DGPO reference uses 0.3 with reference_decay_ramp 0.001"
        )
    _ = algorithm.needs  # with_reference raises when these settings run no reference forward
