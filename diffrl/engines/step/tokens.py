"""What the advantages stage adds for a step of token trajectories (an algorithm whose needs.data is "tokens"): the
algorithm's length shaping of the rewards (Needs.overlong_shaping: DAPO) and verl's language-RL metrics
(response_length/*, prompt_length/*, critic/score/*), beside the names both families share (critic/rewards/*, ...).

Legend: B samples of the step.
"""

from __future__ import annotations

from typing import Any

import torch

from diffrl.engines.handle import Engines


def shape_rewards(engines: Engines, rewards_B: torch.Tensor, traj: Any) -> torch.Tensor:
    """The rewards the advantages are computed from: as scored, or with the algorithm's length penalty."""
    algorithm = engines.config.algorithm
    if not algorithm.needs.overlong_shaping:
        return rewards_B
    shaped = algorithm.shape_rewards(rewards_B, traj.lengths, engines.config.rollout.max_new_tokens)
    return shaped.to(rewards_B.dtype)


def token_metrics(engines: Engines, traj: Any, scores_B: torch.Tensor, kept: torch.Tensor) -> dict[str, float]:
    """verl's names over the step's kept (validly scored) samples: response_length/{mean,max,min,clip_ratio}
    (clip_ratio: responses cut at max_new_tokens, without an end token), prompt_length/{mean,max,min} and
    critic/score/{mean,max,min} (the sequence scores before any shaping)."""
    if kept.numel() == 0:
        return {}
    lengths = traj.lengths[kept].float()
    prompts = torch.tensor([len(traj.prompt_ids[i]) for i in kept.tolist()], dtype=torch.float32)
    eos = getattr(engines.adapter, "eos_token_ids", None) or []
    last = torch.tensor([int(traj.response_ids[i][-1]) if len(traj.response_ids[i]) else -1 for i in kept.tolist()])
    clipped = (lengths >= engines.config.rollout.max_new_tokens) & ~torch.isin(
        last, torch.tensor(eos, dtype=last.dtype)
    )
    if getattr(engines.adapter, "makes_images", False):  # image tokens (Janus): an image is whole at its token count
        clipped = torch.zeros_like(clipped)
    scores = scores_B[kept].float()
    metrics = {}
    for name, values in (("response_length", lengths), ("prompt_length", prompts), ("critic/score", scores)):
        metrics.update({f"{name}/mean": values.mean(), f"{name}/max": values.max(), f"{name}/min": values.min()})
    metrics["response_length/clip_ratio"] = clipped.float().mean()
    return {k: float(v) for k, v in metrics.items()}
