"""Token rollout: the interface every autoregressive rollout engine implements, and the in-process transformers one.

The step core's generate stage calls an engine exactly as it calls the diffusion RolloutEngine -- the chunk's prompts,
group ids, sample indices, seeds and the run's sampling settings -- and gets TokenTrajectories back, which it hands to
the reward in memory and writes to the token store behind the stage (diffrl/engines/step/generate.py). A prompt's
images and audio clips come by path from its dataset row (metadata["images"], metadata["audios"]). The vLLM engine
(a separate server process, its own issue) implements the same protocol; `update_weights` is where it would load the
trainer's weights of a version, which the in-process engine shares already.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from diffrl.configs.rollout import TokenSampling  # re-exported: defined with the other sampling settings
from diffrl.engines.token_trajectories import TokenTrajectories
from diffrl.models.causal_lm.policy import CausalLMPolicy, SamplingParams, TokenPrompt
from diffrl.models.janus.policy import JanusImagePolicy


class TokenRolloutEngine(Protocol):
    """Samples token trajectories; `policy_version` names the weights it samples with."""

    policy_version: int

    def generate(
        self,
        prompts: list[str],
        group_ids: list[str],
        sample_index: list[int],
        seeds: list[int],
        cfg: TokenSampling,
        *,
        step: int = 0,
        policy_version: int = 0,
        metadata: list[dict] | None = None,
        on_batch: Callable[[list[int], list[str]], None] | None = None,
    ) -> TokenTrajectories: ...

    def update_weights(self, version: int) -> None: ...


def length_metrics(lengths: torch.Tensor, clipped: torch.Tensor) -> dict[str, float]:
    """verl's response_length/{mean,max,min,clip_ratio}; clip_ratio: responses cut at max_new_tokens."""
    lengths = lengths.float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float(clipped.float().mean()),
    }


def clipped_responses(traj: TokenTrajectories, max_new_tokens: int, eos_token_ids: list[int]) -> torch.Tensor:
    """(B,) bool: responses that hit max_new_tokens without an end token."""
    last = torch.tensor([int(r[-1]) if len(r) else -1 for r in traj.response_ids])
    return (traj.lengths >= max_new_tokens) & ~torch.isin(last, torch.tensor(eos_token_ids))


class TransformersTokenEngine:
    """In-process rollout with a CausalLMPolicy (transformers `generate`) or a JanusImagePolicy (image tokens with
    CFG, decoded to images); shares its module with the trainer, so `adapter` is the policy the trainer trains."""

    def __init__(self, policy: CausalLMPolicy | JanusImagePolicy):
        self.policy = policy
        self.adapter = policy
        self.policy_version = 0

    def update_weights(self, version: int) -> None:
        """The trainer updated the shared module in place: only the version moves."""
        self.policy_version = version

    def generate(
        self,
        prompts: list[str],
        group_ids: list[str],
        sample_index: list[int],
        seeds: list[int],
        cfg: TokenSampling,
        *,
        step: int = 0,
        policy_version: int = 0,
        metadata: list[dict] | None = None,
        on_batch: Callable[[list[int], list[str]], None] | None = None,
    ) -> TokenTrajectories:
        """One response per row, cfg.batch_size rows per generate call, each call seeded by its first row's seed
        (rows of one prompt may share a call: the call's RNG draws them in turn). `on_batch(rows, outputs)`
        gets each call's row indices and decoded responses (or, for image-token responses, its decoded images) as soon
        as they are there (streamed rewards)."""
        metadata = metadata if metadata is not None else [{} for _ in prompts]
        if not len(prompts) == len(group_ids) == len(sample_index) == len(seeds) == len(metadata):
            raise ValueError("prompts, group_ids, sample_index, seeds and metadata must have one entry per sample")
        rows = [
            TokenPrompt(p, tuple(m.get("images") or ()), tuple(m.get("audios") or ()))
            for p, m in zip(prompts, metadata)
        ]
        parts = []
        for start in range(0, len(rows), cfg.batch_size):
            stop = min(start + cfg.batch_size, len(rows))
            part = self._sample(rows[start:stop], cfg, int(seeds[start]) % (2**63 - 1))
            parts.append(part)
            if on_batch is not None:
                on_batch(list(range(start, stop)), part[3] if part[4] is None else part[4])
        return TokenTrajectories(
            prompts=list(prompts),
            group_ids=list(group_ids),
            sample_index=torch.as_tensor(sample_index, dtype=torch.long),
            seeds=torch.as_tensor(seeds, dtype=torch.long),
            image_paths=[r.images for r in rows],
            prompt_ids=[ids for p in parts for ids in p[0]],
            response_ids=[ids for p in parts for ids in p[1]],
            log_probs=[lp for p in parts for lp in p[2]],
            responses=[text for p in parts for text in p[3]],
            metadata=list(metadata),
            policy_version=policy_version,
            audio_paths=[r.audios for r in rows],
            images=None if parts[0][4] is None else torch.cat([p[4] for p in parts]),
        )

    def _sample(self, rows: list[TokenPrompt], cfg: TokenSampling, seed: int) -> tuple:
        """(prompt ids, response ids, log-probs, texts, images or None) of one generate call, each a per-row list,
        unpadded; images (b, H, W, 3) uint8 when the responses are image tokens (the policy decoded them)."""
        params = SamplingParams(
            n=1, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, stop=cfg.stop, seed=seed
        )
        samples = self.policy.sample(rows, params)
        prompt_mask = samples.prompts.attention_mask.bool()
        lengths = samples.lengths.tolist()
        prompt_ids = [samples.prompts.input_ids[i][prompt_mask[i]].clone() for i in range(len(rows))]
        response_ids = [samples.response_ids[i, :n].clone() for i, n in enumerate(lengths)]
        log_probs = [samples.log_probs[i, :n].float().clone() for i, n in enumerate(lengths)]
        if samples.images is not None:  # image tokens: the policy says what the row's response text is
            return prompt_ids, response_ids, log_probs, self.policy.responses(response_ids), samples.images
        texts = self.policy.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        return prompt_ids, response_ids, log_probs, texts, None
