"""CLIP score: cosine similarity between the CLIP embeddings of the image and of its prompt
(Radford et al., 2021; as a reward e.g. in DDPO/Flow-GRPO evaluations).

score = scale * cos(image_embedding, text_embedding), in [-scale, scale]. Deviation from the
CLIPScore paper (Hessel et al., 2021: 2.5 * max(cos, 0)): no clamping at 0, so the gradient
signal below zero is kept; set scale=2.5 for their scale. Videos: frames averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.engines.reward.base import RewardOutput, iter_batches, register_reward, to_uint8_numpy
from diffrl.engines.reward.clip_backbone import ClipBackbone, ClipOptions, frames_with_owner, mean_per_sample


@dataclass
class ClipScoreOptions(ClipOptions):
    """See ClipOptions for the folder layout; scale multiplies the cosine similarity."""

    scale: float = 1.0

    def __post_init__(self):
        self.validate("clip_score")


class ClipScoreReward:
    """Owns a CLIP model."""

    name = "clip_score"

    def __init__(self, options: ClipScoreOptions):
        self.options = options
        self.batch_size = options.batch_size
        self.backbone = ClipBackbone(options, "clip_score")

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(images)
        if len(array) != len(prompts):
            raise ValueError(f"clip_score: got {len(array)} images and {len(prompts)} prompts")
        frames, owners = frames_with_owner(array, self.options.frame_stride)
        image_embeds = torch.cat(
            [self.backbone.embed_images(frames[s]) for s in iter_batches(len(frames), self.batch_size)]
        )
        text_embeds = self.backbone.embed_texts(prompts)[owners]  # one text row per frame
        per_frame = (image_embeds * text_embeds).sum(dim=-1) * self.options.scale
        return RewardOutput(
            scores=mean_per_sample(per_frame, owners, len(array)),
            valid=torch.ones(len(array), dtype=torch.bool),
        )


@register_reward("clip_score", options=ClipScoreOptions)
def clip_score(options: ClipScoreOptions) -> ClipScoreReward:
    """Image-prompt cosine similarity of a local CLIP model."""
    return ClipScoreReward(options)
