"""GARDO: Gated and Adaptive Regularization with Diversity-aware Optimization (He et al. 2025, "GARDO: Reinforcing
Diffusion Models without Reward Hacking", arXiv:2512.24138; flow_grpo scripts/train_sd3_gardo.py).

Flow-GRPO on denoising steps with three changes against reward hacking: (1) a gated KL that only the samples whose
reward is most uncertain pay, (2) an adaptive reference, the policy copied into the "old" LoRA adapter every
``reference_reset_every`` RL steps, and (3) diversity-aware advantages, (r - group mean) scaled by each above-mean
sample's distance to its nearest group neighbour. The policy loss is
:func:`~diffrl.algorithms.losses_group.gardo_loss`; (1) and (3) are the pure functions below. (1) runs from the
step's reward components (Needs.reward_gate); (3) needs image features the advantages stage does not compute, so the
catalog object refuses it (docs/algorithms.md says what runs).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from diffrl.algorithms.advantages import _group_index
from diffrl.algorithms.base import DiffusionAlgorithm, Metrics, Needs, check_fields
from diffrl.algorithms.batches import StepBatch
from diffrl.algorithms.losses_group import gardo_loss


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """(B,) rank of each score, 1 = the highest (ties in sort order)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, scores.shape[0] + 1)
    return ranks.to(torch.float64)


def uncertainty_gate(main_scores: torch.Tensor, aux_scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """(B,) bool: the samples that pay GARDO's gated KL.

    u_i = rank_main(i) - mean_k rank_aux_k(i) over the batch (rank 1 = highest score; aux_scores (K, B) are the
    auxiliary reward models' scores); among the u >= 0, the threshold is their (1 - fraction) quantile (linear
    interpolation), and gate = u > threshold. flow_grpo adapts `fraction` between 0.02 and 0.2 from a window of past
    steps; here it is given.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1]; got {fraction}")
    main_scores = torch.as_tensor(main_scores).reshape(-1)
    aux_scores = torch.as_tensor(aux_scores).reshape(-1, main_scores.shape[0])
    u = _ranks(main_scores) - torch.stack([_ranks(a) for a in aux_scores]).mean(0)
    candidates = u[u >= 0]
    if candidates.numel() == 0:
        return torch.zeros_like(u, dtype=torch.bool)
    return u > torch.quantile(candidates, 1.0 - fraction)


def diversity_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable], features: torch.Tensor) -> torch.Tensor:
    """(B,) GARDO's diversity-aware advantages (flow_grpo PerPromptStatTracker, type "gardo").

    Per group g: f_i = features_i / ||features_i||, d_i = min_{j in g, j != i} (1 - clip(f_i . f_j, -1, 1));
    A_i = (r_i - mean_g r) * (d_i / mean_g d if r_i >= mean_g r else 1). No division by the std. A group of one
    gets 0. features: (B, F), e.g. an image encoder's embeddings (flow_grpo: DINOv3).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    feats = torch.as_tensor(features, dtype=torch.float64).reshape(rewards.shape[0], -1)
    feats = feats / feats.norm(dim=1, keepdim=True)
    index, num_groups = _group_index(group_ids, rewards.shape[0])
    out = torch.zeros_like(rewards)
    for g in range(num_groups):
        rows = (index == g).nonzero().flatten()
        if rows.numel() < 2:
            continue
        r, f = rewards[rows], feats[rows]
        distance = 1 - (f @ f.T).clamp(-1, 1)
        distance.fill_diagonal_(float("inf"))
        nearest = distance.min(dim=1).values
        centred = r - r.mean()
        out[rows] = centred * torch.where(centred < 0, torch.ones_like(nearest), nearest / nearest.mean())
    return out


@dataclass(frozen=True)
class GARDO(DiffusionAlgorithm):
    """GARDO with Flow-GRPO as its RL algorithm, on denoising steps. The bundle's advantages are not divided by the
    std (norm_by_std False), as GARDO's.

    clip_ratio, adv_clip_max: PPO ratio clip and advantage clamp. kl_coef: weight of the gated KL (0 = none).
    reference_reset_every: the KL's reference is the "old" LoRA adapter, a copy of the policy taken every this many
        RL steps (0 = the initial weights, LoRA off, as Flow-GRPO); 16 is flow_grpo's ``reset_freq`` 15, which copies
        when more than 15 steps have passed since the last copy.
    kl_gate_fraction: the share of the trained samples that pay the KL, those whose main reward is most uncertain
        (uncertainty_gate against the other reward components; 1.0 = every sample, no gate; flow_grpo starts at 0.1).
    main_reward: the reward component the gate ranks against the others (reward.components names; needed when
        kl_gate_fraction < 1, with at least one other component).
    diversity_aware: diversity-aware advantages; only False runs here.

    Deviations: the gate's share is fixed (flow_grpo adapts it in [0.02, 0.2] from the last 20 steps' uncertainty);
    the advantages are plain (r - group mean): the step hands the algorithm no image features (diversity_advantages
    computes them where they exist); the reference is reset on a fixed period only (flow_grpo also resets it when the
    mean KL of an optimizer step exceeds ``kl_thres``).
    """

    NO_EMA_REFERENCE = "its reference already moves: reference_reset_every copies the policy into it"

    norm_by_std: bool = False
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.04
    reference_reset_every: int = 16
    kl_gate_fraction: float = 1.0
    main_reward: str = ""
    diversity_aware: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("clip_ratio", "adv_clip_max"), non_negative=("kl_coef", "reference_reset_every"))
        if not 0 < self.kl_gate_fraction <= 1:
            raise ValueError(f"Algorithm.kl_gate_fraction must be in (0, 1]; got {self.kl_gate_fraction}")
        if self.kl_gate_fraction < 1 and not self.main_reward:
            raise ValueError(
                "Algorithm.main_reward must name the reward component the KL gate ranks against the others when "
                f"kl_gate_fraction < 1 (got {self.kl_gate_fraction})"
            )
        if self.diversity_aware:
            raise ValueError(
                "Algorithm.diversity_aware must be false: diversity-aware advantages need per-sample image features, "
                "which the advantages stage does not compute"
            )

    @property
    def needs(self) -> Needs:
        moving = self.kl_coef > 0 and self.reference_reset_every > 0
        return Needs(
            "denoising_steps",
            old_log_probs=True,
            reference=self.kl_coef > 0,
            moving_reference=moving,
            old_adapter=moving,
            reward_gate=self.kl_coef > 0 and self.kl_gate_fraction < 1,
        )

    def reward_gate(self, components: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) bool: the samples that pay the KL, from the trained samples' reward component scores {name: (B,)}."""
        if self.main_reward not in components or len(components) < 2:
            raise ValueError(
                f"Algorithm.main_reward {self.main_reward!r} must be one of the reward components "
                f"{sorted(components)}, and the KL gate needs at least one other component to rank it against"
            )
        aux = torch.stack([scores for name, scores in components.items() if name != self.main_reward])
        return uncertainty_gate(components[self.main_reward], aux, self.kl_gate_fraction)

    def old_adapter_decay(self, update: int) -> float:
        """0 (copy the policy) every ``reference_reset_every`` updates, else 1 (keep the reference)."""
        if self.reference_reset_every <= 0:
            raise NotImplementedError("GARDO keeps no old adapter when reference_reset_every is 0")
        return 0.0 if update % self.reference_reset_every == 0 else 1.0

    def loss(self, batch: StepBatch) -> tuple[torch.Tensor, Metrics]:
        if self.kl_coef > 0 and batch.ref_prev_sample_mean is None:
            raise ValueError("GARDO with kl_coef > 0 needs the reference's transition mean (ref_prev_sample_mean)")
        return gardo_loss(
            batch.log_prob,
            batch.old_log_prob,
            batch.advantages,
            prev_sample_mean=batch.prev_sample_mean,
            std_dev_t=batch.std_dev_t,
            clip_ratio=self.clip_ratio,
            adv_clip_max=self.adv_clip_max,
            ref_prev_sample_mean=batch.ref_prev_sample_mean,
            kl_gate=batch.kl_gate,
            kl_coef=self.kl_coef,
            weights=batch.weights,
        )
