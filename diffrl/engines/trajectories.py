"""The record one rollout produces and every later stage reads (store, trainer, flows).

Legend: B samples, W window steps (the stochastic steps kept for training), S per-sample latent
shape (the adapter's layout), H/W/F image height, width, frames, C/T audio channels and samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffrl.engines.reward.base import AudioBatch
from diffrl.models.base import ModelAdapter


def decoded_outputs(
    images: torch.Tensor, audio: torch.Tensor | None, sample_rate: int, fps: float | None
) -> torch.Tensor | AudioBatch:
    """What a reward scores of decoded samples: the images, or with audio an AudioBatch of the waveforms and the
    videos they accompany (none for an audio-only model, whose images are (B, 0, 0, 3))."""
    if audio is None:
        return images
    video = images if images.ndim == 5 and images.shape[1] > 0 else None
    return AudioBatch(audio, sample_rate, video, fps if video is not None else None)


def audio_format_of(adapter: ModelAdapter) -> tuple[int, float | None]:
    """(sample rate, fps) the trajectories of `adapter` carry: (0, None) for an adapter without audio; the fps only
    for one whose audio comes with video."""
    if not adapter.has_audio:
        return 0, None
    return adapter.audio_sample_rate, adapter.fps if adapter.visual and adapter.is_video else None


def no_frames(count: int) -> torch.Tensor:
    """The images of an audio-only model's samples: none, (count, 0, 0, 3) uint8 (as a store read without images)."""
    return torch.empty((count, 0, 0, 3), dtype=torch.uint8)


@dataclass
class Trajectories:
    """Denoising trajectories of B samples.

    latents[:, j] is x before window step j and latents[:, j + 1] the sample the rollout drew for
    it, so step j goes latents[:, j] -> latents[:, j + 1] at sigmas[:, j] -> sigmas_prev[:, j].
    step_indices[:, j] is that step's index in the N-step schedule (window_starts + j).
    trained[:, j] marks the steps the trainer replays (a subset of the window, e.g. DanceGRPO).
    """

    prompts: list[str]
    group_ids: list[str]  # prompt uid: samples of one prompt form a group
    sample_index: torch.Tensor  # (B,) int64, index within the group
    seeds: torch.Tensor  # (B,) int64, the per-sample generator seed
    latents: torch.Tensor  # (B, W + 1, *S) float32 -- never bf16
    log_probs: torch.Tensor  # (B, W) float32, rollout log-prob of each window step
    sigmas: torch.Tensor  # (B, W) float32
    sigmas_prev: torch.Tensor  # (B, W) float32
    window_starts: torch.Tensor  # (B,) int64
    trained: torch.Tensor  # (B, W) bool
    images: torch.Tensor  # (B, H, W, 3) or (B, F, H, W, 3) uint8; (B, 0, 0, 3) for an audio-only model
    embed_keys: list[str]  # prompt-embedding cache key of each sample's prompt
    metadata: list[dict] = field(default_factory=list)  # per-sample ground truth etc. (JSON-able)
    policy_version: int = 0
    audio: torch.Tensor | None = None  # (B, C, T) float32 in [-1, 1]: the waveforms of a model that makes audio
    sample_rate: int = 0  # Hz of `audio`
    fps: float | None = None  # frames per second of `images` when they are videos with that audio

    def __post_init__(self) -> None:
        b = len(self.prompts)
        assert self.latents.dtype == torch.float32, "latents must be stored in fp32"
        assert self.latents.shape[0] == b and self.log_probs.shape[0] == b and self.images.shape[0] == b
        assert self.latents.shape[1] == self.log_probs.shape[1] + 1
        if self.audio is not None:
            assert self.audio.dtype == torch.float32 and self.audio.ndim == 3 and self.audio.shape[0] == b
            assert self.sample_rate > 0, "audio needs its sample rate"
        if not self.metadata:
            self.metadata = [{} for _ in range(b)]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def outputs(self) -> torch.Tensor | AudioBatch:
        """What a reward scores: the decoded images (a token rollout's are its response texts), or for a model that
        makes audio an AudioBatch of the waveforms with the videos they accompany (None for an audio-only model)."""
        return decoded_outputs(self.images, self.audio, self.sample_rate, self.fps)

    @property
    def window_size(self) -> int:
        return self.log_probs.shape[1]

    @property
    def step_indices(self) -> torch.Tensor:
        """(B, W) int64 index of each window step in the denoising schedule."""
        return self.window_starts[:, None] + torch.arange(self.window_size)[None, :]

    def select(self, index: torch.Tensor | list[int]) -> "Trajectories":
        """A subset of samples (rows), e.g. one micro-batch."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return Trajectories(
            prompts=[self.prompts[i] for i in rows],
            group_ids=[self.group_ids[i] for i in rows],
            sample_index=self.sample_index[idx],
            seeds=self.seeds[idx],
            latents=self.latents[idx],
            log_probs=self.log_probs[idx],
            sigmas=self.sigmas[idx],
            sigmas_prev=self.sigmas_prev[idx],
            window_starts=self.window_starts[idx],
            trained=self.trained[idx],
            images=self.images[idx],
            embed_keys=[self.embed_keys[i] for i in rows],
            metadata=[self.metadata[i] for i in rows],
            policy_version=self.policy_version,
            audio=None if self.audio is None else self.audio[idx],
            sample_rate=self.sample_rate,
            fps=self.fps,
        )

    @staticmethod
    def cat(parts: list["Trajectories"]) -> "Trajectories":
        """Concatenate chunks of one step (same window size and latent shape)."""
        return Trajectories(
            prompts=[p for t in parts for p in t.prompts],
            group_ids=[g for t in parts for g in t.group_ids],
            sample_index=torch.cat([t.sample_index for t in parts]),
            seeds=torch.cat([t.seeds for t in parts]),
            latents=torch.cat([t.latents for t in parts]),
            log_probs=torch.cat([t.log_probs for t in parts]),
            sigmas=torch.cat([t.sigmas for t in parts]),
            sigmas_prev=torch.cat([t.sigmas_prev for t in parts]),
            window_starts=torch.cat([t.window_starts for t in parts]),
            trained=torch.cat([t.trained for t in parts]),
            images=torch.cat([t.images for t in parts]),
            embed_keys=[k for t in parts for k in t.embed_keys],
            metadata=[m for t in parts for m in t.metadata],
            policy_version=min(t.policy_version for t in parts),  # the oldest, as the store reads a step
            audio=None if parts[0].audio is None else torch.cat([t.audio for t in parts]),
            sample_rate=parts[0].sample_rate,
            fps=parts[0].fps,
        )
