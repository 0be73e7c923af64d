"""Group-relative advantages (GRPO) and the reward/advantage statistics the trainer logs.

A group is the set of samples generated for one prompt. The advantage of sample i in group g is
(r_i - mean_g) / (std + eps), where std is the std of the whole batch (``global_std``, flow_grpo's
``sample.global_std = True``) or of group g, with ``ddof`` 0 (the population std, flow_grpo's
PerPromptStatTracker) or 1 (the sample std: DanceGRPO divides by the group's ``torch.std`` + 1e-8, and
verl-omni's estimator uses it too). ``norm_by_std=False`` is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783):
r_i - mean_g.

A group of one gets advantage 0 (its mean is its reward; with ddof 1 its std, undefined, counts as 0).
At DanceGRPO's 12 samples per group, ddof 0 gives advantages sqrt(12/11) = 1.044 times ddof 1's.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch


def _group_index(group_ids, batch: int) -> tuple[torch.Tensor, int]:
    """(B,) int64 dense group index and the number of groups, from ids or an int tensor."""
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.reshape(-1).tolist()
    else:
        ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids must hold one id per reward (B={batch}); got {len(ids)}")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.int64), len(dense)


def _group_moments(rewards: torch.Tensor, index: torch.Tensor, num_groups: int, ddof: int = 0):
    """Per-group (count, mean, std with `ddof`), each (G,); a group of at most `ddof` samples has std 0."""
    index = index.to(rewards.device)
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, index, torch.ones_like(rewards)
    )
    mean = torch.zeros_like(count).index_add_(0, index, rewards) / count
    centered = rewards - mean[index]
    squares = torch.zeros_like(count).index_add_(0, index, centered**2)
    var = torch.where(count > ddof, squares / (count - ddof).clamp_min(1), torch.zeros_like(count))
    return count, mean, var.sqrt()


def _constant_groups(rewards: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(G,) bool: max == min inside the group (exact; a float std of equal values can be 1e-17)."""
    index = index.to(rewards.device)
    init = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    high = init.scatter_reduce(0, index, rewards, reduce="amax", include_self=False)
    low = init.scatter_reduce(0, index, rewards, reduce="amin", include_self=False)
    return high == low


def _as_rewards(rewards) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    rewards = rewards.to(dtype).reshape(-1)
    if rewards.numel() == 0:
        raise ValueError("rewards must not be empty")
    return rewards


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    global_std: bool = True,
    eps: float = 1e-4,
    ddof: int = 0,
) -> torch.Tensor:
    """(r - group mean) / (std + eps) per sample; (B,) fp32 (fp64 if rewards are fp64).

    Args:
        rewards: (B,) scalar rewards.
        group_ids: B hashable ids (e.g. prompt strings) or a (B,) int tensor.
        norm_by_std: divide by std + eps (False = Dr.GRPO).
        global_std: std of the whole batch (True) or of each group (False).
        eps: added to the std.
        ddof: 0 for the population std (flow_grpo), 1 for the sample std (DanceGRPO, verl-omni).
    """
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 (population std) or 1 (sample std); got {ddof}")
    rewards = _as_rewards(rewards)
    index, num_groups = _group_index(group_ids, rewards.shape[0])
    _, mean, group_std = _group_moments(rewards, index, num_groups, ddof)
    index = index.to(rewards.device)
    centered = rewards - mean[index]
    if not norm_by_std:
        return centered
    if global_std:
        std = rewards.std(correction=ddof) if rewards.numel() > ddof else rewards.new_zeros(())
    else:
        std = group_std[index]
    return centered / (std + eps)


def reward_stats(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> dict[str, float]:
    """critic/rewards/{mean,max,min,zero_std_ratio,std_mean,group_size} (the names verl logs).

    zero_std_ratio: fraction of groups whose rewards are all equal (they give no signal);
    std_mean: mean over groups of the group's population std; group_size: mean group size.
    """
    rewards = _as_rewards(rewards)
    index, num_groups = _group_index(group_ids, rewards.shape[0])
    count, _, group_std = _group_moments(rewards, index, num_groups)
    return {
        "critic/rewards/mean": float(rewards.mean()),
        "critic/rewards/max": float(rewards.max()),
        "critic/rewards/min": float(rewards.min()),
        "critic/rewards/zero_std_ratio": float(_constant_groups(rewards, index, num_groups).to(rewards.dtype).mean()),
        "critic/rewards/std_mean": float(group_std.mean()),
        "critic/rewards/group_size": float(count.mean()),
    }


def advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    """critic/advantages/{mean,max,min}."""
    advantages = _as_rewards(advantages)
    return {
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
    }
