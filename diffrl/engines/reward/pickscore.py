"""PickScore (Kirstain et al., 2023, "Pick-a-Pic"): a CLIP-H fine-tuned on human preferences.

score = exp(logit_scale) * cos(image_embedding, text_embedding) / normaliser, as the reference
`calc_probs` computes the logits before the softmax over candidates. normaliser defaults to 26
(Flow-GRPO divides by 26 so a good image scores ~0.8-0.9). Videos: frames averaged.

Layout: the PickScore_v1 CLIPModel folder (format "transformers") with the processor files of
CLIP-ViT-H-14 copied into it (or `processor_path` pointing at them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.engines.reward.base import RewardOutput, check_positive, iter_batches, register_reward, to_uint8_numpy
from diffrl.engines.reward.clip_backbone import ClipBackbone, ClipOptions, frames_with_owner, mean_per_sample


@dataclass
class PickScoreOptions(ClipOptions):
    """See ClipOptions; normaliser divides the logit (26 as in Flow-GRPO; 1 for raw logits)."""

    normaliser: float = 26.0

    def __post_init__(self):
        self.validate("pickscore")
        check_positive(self.normaliser, "normaliser", "pickscore")


class PickScoreReward:
    """Owns the PickScore CLIP model."""

    name = "pickscore"

    def __init__(self, options: PickScoreOptions):
        self.options = options
        self.batch_size = options.batch_size
        self.backbone = ClipBackbone(options, "pickscore")

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(images)
        if len(array) != len(prompts):
            raise ValueError(f"pickscore: got {len(array)} images and {len(prompts)} prompts")
        frames, owners = frames_with_owner(array, self.options.frame_stride)
        image_embeds = torch.cat(
            [self.backbone.embed_images(frames[s]) for s in iter_batches(len(frames), self.batch_size)]
        )
        text_embeds = self.backbone.embed_texts(prompts)[owners]
        logits = self.backbone.logit_scale * (image_embeds * text_embeds).sum(dim=-1)
        return RewardOutput(
            scores=mean_per_sample(logits / self.options.normaliser, owners, len(array)),
            valid=torch.ones(len(array), dtype=torch.bool),
        )


@register_reward("pickscore", options=PickScoreOptions)
def pickscore(options: PickScoreOptions) -> PickScoreReward:
    """Human-preference score of a local PickScore checkpoint."""
    return PickScoreReward(options)
