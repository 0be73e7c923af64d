"""Aesthetic score: the LAION improved aesthetic predictor (Schuhmann et al., 2022; the DDPO
aesthetic reward): an MLP on the L2-normalised CLIP ViT-L/14 image embedding, predicting a 1-10
rating. The prompt is not used. Videos: frames averaged.

Layout: `model_path` is a CLIP folder (see clip_backbone), and `head_path` (default
`<model_path>/aesthetic_head.safetensors`) holds the head as safetensors with keys
`layers.<i>.weight` (out, in) and `layers.<i>.bias` (out,). The linear layers are applied in
ascending <i> with nothing in between: the LAION MLP's Dropouts are identities at inference and
it has no activations, so its `sac+logos+ava1-l14-linearMSE.pth` state dict (layers.0, 2, 4, 6,
7) converts key-for-key (see docs/rewards.md). We never unpickle: only safetensors is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.engines.reward.base import RewardOutput, iter_batches, register_reward, to_uint8_numpy
from diffrl.engines.reward.clip_backbone import ClipBackbone, ClipOptions, frames_with_owner, mean_per_sample

HEAD_FILE = "aesthetic_head.safetensors"
_KEY = re.compile(r"^layers\.(\d+)\.(weight|bias)$")


@dataclass
class AestheticOptions(ClipOptions):
    """See ClipOptions; head_path: the MLP head (default <model_path>/aesthetic_head.safetensors)."""

    head_path: str | None = None

    def __post_init__(self):
        self.validate("aesthetic")


def load_head(path: Path, embed_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(weight, bias), ...] in layer order; checks the shapes chain from embed_dim to 1."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"aesthetic: head file {str(path)!r} does not exist (option 'head_path')")
    tensors = load_file(str(path))
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"aesthetic: unexpected key {key!r} in {path}; expected layers.<i>.weight/bias")
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = value.float()
    head, width = [], embed_dim
    for index in sorted(layers):
        if set(layers[index]) != {"weight", "bias"}:
            raise ValueError(f"aesthetic: layer {index} in {path} needs both weight and bias")
        weight, bias = layers[index]["weight"], layers[index]["bias"]
        if weight.ndim != 2 or weight.shape[1] != width or bias.shape != (weight.shape[0],):
            raise ValueError(f"aesthetic: layer {index} has weight {tuple(weight.shape)}, expected (*, {width})")
        head.append((weight, bias))
        width = weight.shape[0]
    if not head or width != 1:
        raise ValueError(f"aesthetic: the head in {path} must end in one output, got {width}")
    return head


class AestheticReward:
    """Owns a CLIP image tower and the MLP head."""

    name = "aesthetic"

    def __init__(self, options: AestheticOptions):
        self.options = options
        self.batch_size = options.batch_size
        head_path = Path(options.head_path or Path(options.model_path) / HEAD_FILE)
        if not head_path.is_file():  # checked before the (slow) CLIP load
            raise ValueError(f"aesthetic: head file {str(head_path)!r} does not exist (option 'head_path')")
        self.backbone = ClipBackbone(options, "aesthetic")
        self.head = load_head(head_path, self.backbone.embed_dim)

    def predict(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(N, D) normalised embeddings -> (N,) predicted ratings, fp32 on CPU."""
        hidden = embeddings.float().cpu()
        for weight, bias in self.head:
            hidden = hidden @ weight.T + bias
        return hidden[:, 0]

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(images)
        frames, owners = frames_with_owner(array, self.options.frame_stride)
        embeds = torch.cat([self.backbone.embed_images(frames[s]) for s in iter_batches(len(frames), self.batch_size)])
        return RewardOutput(
            scores=mean_per_sample(self.predict(embeds), owners, len(array)),
            valid=torch.ones(len(array), dtype=torch.bool),
        )


@register_reward("aesthetic", options=AestheticOptions)
def aesthetic(options: AestheticOptions) -> AestheticReward:
    """LAION aesthetic predictor (CLIP embedding -> MLP head) from local files."""
    return AestheticReward(options)
