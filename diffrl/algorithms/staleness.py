"""How stale each sample of an asynchronous step is when it trains, and which prompt groups are too stale to train
(docs/algorithms.md, "Off-policy correction").

A sample generated with policy version v and trained while the trainer is at version t has staleness t - v. With
`max_staleness` s, a prompt group trains only if every one of its samples has staleness <= s: a group is generated at
one version, and its advantages are relative to its own samples, so it is kept or dropped whole.

Legend: B samples of a step.
"""

from __future__ import annotations

import torch


def sample_staleness(versions_B: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """(B,) int64: how many policy versions lie between each sample's behaviour policy and the trainer's. A sample of
    a version the trainer has not reached (kept rows of a step that a resume from an older checkpoint trains again)
    counts its distance too: its policy is not the trainer's either."""
    return (trainer_version - torch.as_tensor(versions_B, dtype=torch.int64)).abs()


def fresh_groups(staleness_B: torch.Tensor, group_ids: list[str], max_staleness: int) -> torch.Tensor:
    """(B,) bool: True where every sample of the sample's prompt group has staleness <= max_staleness."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0; got {max_staleness}")
    stale = {g for g, s in zip(group_ids, staleness_B.tolist()) if s > max_staleness}
    return torch.tensor([g not in stale for g in group_ids], dtype=torch.bool)


def staleness_stats(staleness_B: torch.Tensor, kept_B: torch.Tensor) -> dict[str, float]:
    """async/staleness_{mean,max} over the kept samples (0 when none is kept) and async/dropped, the samples left
    out for their group's staleness."""
    kept = staleness_B[kept_B].double()
    return {
        "async/staleness_mean": float(kept.mean()) if kept.numel() else 0.0,
        "async/staleness_max": float(kept.max()) if kept.numel() else 0.0,
        "async/dropped": float((~kept_B).sum()),
    }
