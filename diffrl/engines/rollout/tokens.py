"""Token rollout: the interface every autoregressive rollout engine implements, and the in-process transformers one.

An engine samples n responses per prompt with per-token log-probs under the policy version it holds and appends them
to the token trajectory table (engines/store/tokens.py); it returns a small summary, never tensors. The vLLM engine
(a separate server process, its own issue) implements the same protocol; ``update_weights`` is where it would load
the trainer's weights of a version, which the in-process engine shares already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from diffrl.engines.store.tokens import TokenTrajectoryTable
from diffrl.models.causal_lm import CausalLMPolicy, SamplingParams, TokenPrompt, TokenSamples


@dataclass(frozen=True)
class TokenRollout:
    """What a rollout wrote: step, rows, the policy version that sampled them and verl's length metrics."""

    step: int
    rows: int
    policy_version: int
    metrics: dict[str, float]


class TokenRolloutEngine(Protocol):
    """Samples token trajectories into a table; `policy_version` names the weights it samples with."""

    policy_version: int

    def generate(
        self, step: int, prompts: list[TokenPrompt], group_ids: list[str], params: SamplingParams
    ) -> TokenRollout: ...

    def update_weights(self, version: int) -> None: ...


def length_metrics(samples: TokenSamples, max_tokens: int, eos_token_ids: list[int]) -> dict[str, float]:
    """verl's response_length/{mean,max,min,clip_ratio}; clip_ratio: responses cut at max_tokens (no end token)."""
    lengths = samples.lengths
    last = samples.response_ids.gather(1, (lengths - 1).clamp_min(0)[:, None]).squeeze(1)
    clipped = (lengths >= max_tokens) & ~torch.isin(last, torch.tensor(eos_token_ids))
    return {
        "response_length/mean": float(lengths.float().mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float(clipped.float().mean()),
    }


class TransformersTokenEngine:
    """In-process rollout with a CausalLMPolicy (transformers ``generate``); shares its weights with the trainer."""

    def __init__(self, policy: CausalLMPolicy, table: TokenTrajectoryTable):
        self.policy = policy
        self.table = table
        self.policy_version = 0

    def update_weights(self, version: int) -> None:
        """The trainer updated the shared module in place: only the version moves."""
        self.policy_version = version

    def generate(
        self, step: int, prompts: list[TokenPrompt], group_ids: list[str], params: SamplingParams
    ) -> TokenRollout:
        """n samples of each prompt (group `group_ids[i]`, sample_index 0..n-1) appended to the table."""
        if len(group_ids) != len(prompts):
            raise ValueError(f"group_ids must hold one id per prompt ({len(prompts)}); got {len(group_ids)}")
        samples = self.policy.sample(prompts, params)
        prompt_mask = samples.prompts.attention_mask.bool()
        rows = range(samples.response_ids.shape[0])
        self.table.write(
            step,
            [group_ids[i // params.n] for i in rows],
            [i % params.n for i in rows],
            policy_version=self.policy_version,
            prompts=[prompts[i // params.n].text for i in rows],
            images=[prompts[i // params.n].images for i in rows],
            prompt_ids=[samples.prompts.input_ids[i][prompt_mask[i]].tolist() for i in rows],
            response_ids=[samples.response_ids[i, : samples.lengths[i]].tolist() for i in rows],
            log_probs=[samples.log_probs[i, : samples.lengths[i]].tolist() for i in rows],
        )
        metrics = length_metrics(samples, params.max_tokens, self.policy.eos_token_ids)
        return TokenRollout(step, len(rows), self.policy_version, metrics)
