"""Weighted multi-reward: total = sum_i w_i * score_i over the configured components.

Exclusion rules (never a silent 0):
- A component that returns valid False (or a non-finite score) for a sample excludes that sample from
  the total (total NaN, valid False), logged and counted in info["excluded"].
- A component that raises: if `required` (the default), the error propagates as a RewardError
  naming the component; if `required: false` it is down for that batch: left out of the batch's totals
  (its scores NaN, "<name>/error" says why; logged) while other components remain. With none remaining,
  every sample of the batch is excluded. A step drops a component that was down for part of it from
  every sample's total (`drop_partial_components`), so the samples of a group stay comparable.
A chunk whose every sample is excluded fails its score stage with `exclusion_report`'s message.

info of the combined output (per-sample lists, length B):
  "<name>"          the component's score (NaN where it excluded the sample)
  "<name>/<key>"    the component's own info (recognised text, judge answers, ...); a
                    non-required component that raised reports only "<name>/error"
  "excluded"        True where the sample is excluded
  "excluded_by"     the names of the components that excluded it
This class is the whole scoring logic of the pool: a thread, a spawned process or a Ray actor
just holds one MultiReward and calls it on chunks.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from diffrl.configs.reward import RewardConfig
from diffrl.engines.reward.base import (
    RewardError,
    RewardFunction,
    RewardOutput,
    build_reward,
    concat_outputs,
    iter_batches,
    to_samples,
)

logger = logging.getLogger(__name__)


def score_in_batches(reward: RewardFunction, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
    """Calls `reward` on slices of its own batch_size and concatenates (per-function batching)."""
    outputs = []
    for part in iter_batches(len(prompts), reward.batch_size):
        output = reward(images[part], prompts[part], metadata[part])
        if len(output.scores) != part.stop - part.start:
            expected = part.stop - part.start
            raise RewardError(
                f"reward {reward.name!r} returned {len(output.scores)} scores for {expected} samples", reward.name
            )
        outputs.append(output)
    return concat_outputs(outputs)


def combine(outputs: dict[str, RewardOutput], weights: dict[str, float], down: frozenset = frozenset()) -> RewardOutput:
    """Weighted sum of component outputs (same batch) with the exclusion rules of this module; `down`: the
    non-required components that failed on the batch (left out of the total while another component remains)."""
    names = list(outputs)
    count = len(outputs[names[0]].scores)
    valid = torch.ones(count, dtype=torch.bool)
    total = torch.zeros(count, dtype=torch.float32)
    info: dict[str, list] = {"excluded_by": [[] for _ in range(count)]}
    remaining = [name for name in names if name not in down]
    for name in names:
        out = outputs[name]
        for key, values in out.info.items():
            info[f"{name}/{key}"] = list(values)
        if name in down and remaining:
            info[name] = [math.nan] * count
            continue
        usable = out.valid & torch.isfinite(out.scores)  # a NaN score marked valid is excluded all the same
        if not bool((usable == out.valid).all()):
            errors = info.setdefault(f"{name}/error", [""] * count)
            for index in torch.nonzero(out.valid & ~usable).flatten().tolist():
                errors[index] = f"non-finite score {float(out.scores[index])}"
        valid &= usable
        # where() keeps NaN of excluded samples out of the arithmetic of valid ones
        total += weights[name] * torch.where(usable, out.scores, torch.zeros_like(out.scores))
        info[name] = [float(s) if v else math.nan for s, v in zip(out.scores.tolist(), usable.tolist())]
        for index in torch.nonzero(~usable).flatten().tolist():
            info["excluded_by"][index].append(name)
    info["excluded"] = (~valid).tolist()
    total[~valid] = math.nan
    return RewardOutput(scores=total, valid=valid, info=info)


def exclusion_report(output: RewardOutput, names: list[str]) -> str:
    """Why samples of `output` were excluded: how many, by which component, and the first reason each gave
    ("http_scorer excluded 4 (error: malformed: no finite number under 'score' ...)")."""
    excluded = [i for i, flag in enumerate(output.info.get("excluded", (~output.valid).tolist())) if flag]
    parts = []
    for name in names:
        by_it = [i for i in excluded if name in output.info["excluded_by"][i]]
        if not by_it:
            continue
        reasons = [
            f"{key.split('/', 1)[1]}: {str(values[by_it[0]])[:200]}"
            for key, values in output.info.items()
            if key.startswith(f"{name}/") and values[by_it[0]] not in (None, "")
        ]
        down = str(output.info.get(f"{name}/error", [""] * len(output.valid))[by_it[0]] or "").startswith("down:")
        alone = " (not required: it was down and no other component remained)" if down else ""
        parts.append(f"{name}{alone} excluded {len(by_it)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    return f"{len(excluded)} of {len(output.valid)} samples excluded by the reward: " + ", ".join(parts)


def drop_partial_components(
    rewards: torch.Tensor, components: dict[str, torch.Tensor], valid: torch.Tensor, weights: dict[str, float]
) -> tuple[torch.Tensor, list[str]]:
    """A step's totals without the components that were down for part of it (NaN on a sample no component
    excluded): every sample's total then sums the same components. Returns (rewards, the components left out);
    the rewards come back unchanged when none was down."""
    partial = [name for name in weights if name in components and bool(components[name][valid].isnan().any())]
    if not partial:
        return rewards, []
    kept = [name for name in weights if name in components and name not in partial]
    if not kept:
        raise RewardError(
            f"no reward component scored every sample of the step: {', '.join(partial)} were down for part of it "
            "and no other component remains",
            partial[0],
        )
    total = sum(weights[name] * components[name] for name in kept)
    return torch.where(valid, total, torch.full_like(total, math.nan)), partial


def reward_metrics(output: RewardOutput, names: list[str]) -> dict[str, float]:
    """reward/<name>: mean of that component's valid scores (NaN if none); reward/excluded: count."""
    metrics = {}
    for name in names:
        values = np.asarray(output.info[name], dtype=np.float64)
        finite = values[~np.isnan(values)]
        metrics[f"reward/{name}"] = float(finite.mean()) if finite.size else math.nan
    metrics["reward/excluded"] = float(sum(output.info["excluded"]))
    return metrics


class MultiReward:
    """Owns the built reward functions of a RewardConfig (models, clients)."""

    def __init__(self, config: RewardConfig):
        self.config = config
        # build_reward checks folders, keys and options now: start-up, not mid-run
        self.rewards = {c.name: build_reward(c.name, c.options) for c in config.components}
        self.weights = {c.name: c.weight for c in config.components}
        self.required = {c.name: c.required for c in config.components}

    @property
    def names(self) -> list[str]:
        """Component names in config order."""
        return list(self.rewards)

    def score_component(self, name: str, images, prompts: list[str], metadata: list[dict]) -> tuple[RewardOutput, bool]:
        """One component on the batch, and whether it is down (a non-required one that failed: no scores, its
        error under "error"); a required one that fails raises RewardError naming it."""
        try:
            return score_in_batches(self.rewards[name], images, prompts, metadata), False
        except Exception as e:
            if self.required[name]:
                if isinstance(e, RewardError) and e.reward_name == name:
                    raise
                raise RewardError(f"reward {name!r} failed: {type(e).__name__}: {e}", name) from e
            logger.warning("reward %r (not required) failed on %d samples; left out of them: %s", name, len(prompts), e)
            error = f"down: {type(e).__name__}: {e}"
            return RewardOutput.from_lists([None] * len(prompts), info={"error": [error] * len(prompts)}), True

    def nothing_scored(self, output: RewardOutput, where: str) -> RewardError:
        """The error of a batch (`where`: "step 3 chunk 1") whose every sample was excluded: which component, how
        many and why (exclusion_report)."""
        first = next((names[0] for names in output.info["excluded_by"] if names), self.names[0])
        return RewardError(
            f"{where}: {exclusion_report(output, self.names)}. Nothing of it is kept: once the reward answers "
            "again, rerun the same command and it is scored again",
            first,
        )

    def __call__(self, images, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        """Scores a batch with every component and combines them (see the module docstring)."""
        array = to_samples(images)  # images/videos, or the text responses of a token rollout
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        if not len(array) == len(prompts) == len(metadata):
            raise ValueError(f"got {len(array)} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
        scored = {name: self.score_component(name, array, prompts, metadata) for name in self.rewards}
        outputs = {name: out for name, (out, _) in scored.items()}
        combined = combine(outputs, self.weights, frozenset(name for name, (_, down) in scored.items() if down))
        excluded = sum(combined.info["excluded"])
        if excluded:
            logger.warning("excluded %d of %d samples: %s", excluded, len(prompts), combined.info["excluded_by"])
        return combined
