"""The record a token rollout produces and every later stage reads: the autoregressive twin of
diffrl/engines/trajectories.py, with the same row identity (group_ids, sample_index) and the same methods the step
core calls (`len`, `select`, `cat`, `outputs`).

Legend: B samples. Token lists are ragged (each sample's own length, no padding): prompt_ids[i] is (P_i,),
response_ids[i] and log_probs[i] are (T_i,), T_i counting the response's end token when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTrajectories:
    """Sampled responses of B samples of an autoregressive policy.

    prompts: the user text of each sample's prompt; image_paths: the images it showed (files, never pixels);
    audio_paths: the audio clips it played (WAV files, never waveforms; none by default).
    log_probs: the rollout's per-token log-probs of its own response (temperature-scaled, fp32).
    responses: the decoded response text (special tokens left out): what the reward scores.
    images: for a policy whose responses are image tokens (Janus, diffrl/models/janus/policy.py), the decoded uint8
    images (B, H, W, 3): then what the reward scores; None for text responses.
    metadata: per-sample ground truth etc. (JSON-able), as the prompt dataset gave it.
    """

    prompts: list[str]
    group_ids: list[str]  # prompt uid: samples of one prompt form a group
    sample_index: torch.Tensor  # (B,) int64, index within the group
    seeds: torch.Tensor  # (B,) int64, the seed of the sampling call that drew the sample
    image_paths: list[tuple[str, ...]]
    prompt_ids: list[torch.Tensor]  # (P_i,) int64 each
    response_ids: list[torch.Tensor]  # (T_i,) int64 each
    log_probs: list[torch.Tensor]  # (T_i,) float32 each
    responses: list[str]
    metadata: list[dict] = field(default_factory=list)
    policy_version: int = 0
    audio_paths: list[tuple[str, ...]] = field(default_factory=list)
    images: torch.Tensor | None = None  # (B, H, W, 3) uint8

    def __post_init__(self) -> None:
        b = len(self.prompts)
        if not self.metadata:
            self.metadata = [{} for _ in range(b)]
        if not self.audio_paths:
            self.audio_paths = [() for _ in range(b)]
        lists = (self.group_ids, self.image_paths, self.audio_paths, self.prompt_ids, self.response_ids, self.log_probs)
        assert all(len(x) == b for x in (*lists, self.responses, self.metadata))
        assert self.sample_index.shape == (b,) and self.seeds.shape == (b,)
        assert all(r.shape == lp.shape for r, lp in zip(self.response_ids, self.log_probs))
        assert self.images is None or (self.images.shape[0] == b and self.images.dtype == torch.uint8)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def outputs(self) -> list[str] | torch.Tensor:
        """What a reward scores: the response texts, or the decoded images of image-token responses (a diffusion
        rollout's are its images)."""
        return self.responses if self.images is None else self.images

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) response tokens of each sample."""
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)

    def select(self, index: torch.Tensor | list[int]) -> TokenTrajectories:
        """A subset of samples (rows), e.g. one micro-batch."""
        rows = torch.as_tensor(index, dtype=torch.long).tolist()
        return TokenTrajectories(
            prompts=[self.prompts[i] for i in rows],
            group_ids=[self.group_ids[i] for i in rows],
            sample_index=self.sample_index[rows],
            seeds=self.seeds[rows],
            image_paths=[self.image_paths[i] for i in rows],
            prompt_ids=[self.prompt_ids[i] for i in rows],
            response_ids=[self.response_ids[i] for i in rows],
            log_probs=[self.log_probs[i] for i in rows],
            responses=[self.responses[i] for i in rows],
            metadata=[self.metadata[i] for i in rows],
            policy_version=self.policy_version,
            audio_paths=[self.audio_paths[i] for i in rows],
            images=None if self.images is None else self.images[rows],
        )

    @staticmethod
    def cat(parts: list[TokenTrajectories]) -> TokenTrajectories:
        """Concatenate chunks of one step."""
        return TokenTrajectories(
            prompts=[p for t in parts for p in t.prompts],
            group_ids=[g for t in parts for g in t.group_ids],
            sample_index=torch.cat([t.sample_index for t in parts]),
            seeds=torch.cat([t.seeds for t in parts]),
            image_paths=[p for t in parts for p in t.image_paths],
            prompt_ids=[p for t in parts for p in t.prompt_ids],
            response_ids=[r for t in parts for r in t.response_ids],
            log_probs=[lp for t in parts for lp in t.log_probs],
            responses=[r for t in parts for r in t.responses],
            metadata=[m for t in parts for m in t.metadata],
            policy_version=min(t.policy_version for t in parts),  # the oldest, as the store reads a step
            audio_paths=[p for t in parts for p in t.audio_paths],
            images=None if parts[0].images is None else torch.cat([t.images for t in parts]),
        )

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(response_ids, log_probs, mask), each (B, T) right-padded to the longest response (pad id 0, mask 0)."""
        width = max((len(r) for r in self.response_ids), default=0)
        ids = torch.zeros((len(self), width), dtype=torch.long)
        log_probs = torch.zeros((len(self), width), dtype=torch.float32)
        mask = torch.zeros((len(self), width), dtype=torch.bool)
        for i, (r, lp) in enumerate(zip(self.response_ids, self.log_probs)):
            ids[i, : len(r)], log_probs[i, : len(r)], mask[i, : len(r)] = r, lp, True
        return ids, log_probs, mask
