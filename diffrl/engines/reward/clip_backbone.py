"""A CLIP model loaded from a local folder, shared by clip_score, pickscore and aesthetic.

Folder layouts:
- format "transformers": a `CLIPModel.save_pretrained` folder (config.json + model.safetensors)
  that also holds the processor files (preprocessor_config.json and the tokenizer files, as
  `CLIPProcessor.save_pretrained` writes them). `processor_path` may point elsewhere for them.
- format "open_clip": a folder with `open_clip_model.safetensors` (the file open_clip itself
  pushes to the Hub), plus the option `open_clip_model` naming its architecture (e.g.
  "ViT-H-14"). Needs the optional `open_clip_torch` package; never a pickle checkpoint.
Every check (folder, files, package) happens at construction, i.e. at reward build time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffrl.engines.reward.base import check_choice, check_folder, check_positive, sample_frames

FORMATS = ("transformers", "open_clip")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ClipOptions:
    """Options shared by the CLIP-family rewards. device: torch device string; dtype: model weights."""

    model_path: str
    format: str = "transformers"
    processor_path: str | None = None
    open_clip_model: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    frame_stride: int = 4
    batch_size: int = 32

    def validate(self, owner: str) -> None:
        """Value checks (called from each reward's __post_init__ with its name)."""
        check_choice(self.format, "format", owner, FORMATS)
        check_choice(self.dtype, "dtype", owner, tuple(DTYPES))
        check_positive(self.frame_stride, "frame_stride", owner)
        check_positive(self.batch_size, "batch_size", owner)
        if self.format == "open_clip" and not self.open_clip_model:
            raise ValueError(f"{owner}: format 'open_clip' needs option 'open_clip_model' (e.g. 'ViT-H-14')")


class ClipBackbone:
    """Owns a CLIP model + its preprocessing; returns L2-normalised fp32 embeddings."""

    def __init__(self, options: ClipOptions, owner: str):
        self.device = torch.device(options.device)
        self.dtype = DTYPES[options.dtype]
        if options.format == "transformers":
            self._load_transformers(options, owner)
        else:
            self._load_open_clip(options, owner)

    def _load_transformers(self, options: ClipOptions, owner: str) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        folder = check_folder(options.model_path, "model_path", owner, ("config.json",))
        processor_folder = check_folder(
            options.processor_path or folder, "processor_path", owner, ("preprocessor_config.json",)
        )
        self.model = CLIPModel.from_pretrained(folder, dtype=self.dtype).to(self.device).eval()
        self.image_processor = AutoImageProcessor.from_pretrained(processor_folder)
        self.tokenizer = AutoTokenizer.from_pretrained(processor_folder)
        self.kind = "transformers"

    def _load_open_clip(self, options: ClipOptions, owner: str) -> None:
        try:
            import open_clip
        except ImportError:
            raise ValueError(
                f"{owner}: format 'open_clip' needs the open_clip package: pip install open_clip_torch"
            ) from None
        folder = check_folder(options.model_path, "model_path", owner, ("open_clip_model.safetensors",))
        self.model, _, self.open_clip_preprocess = open_clip.create_model_and_transforms(
            options.open_clip_model, pretrained=str(folder / "open_clip_model.safetensors")
        )
        self.model = self.model.to(self.device, self.dtype).eval()
        self.open_clip_tokenizer = open_clip.get_tokenizer(options.open_clip_model)
        self.kind = "open_clip"

    @property
    def embed_dim(self) -> int:
        """Width of the (projected) image/text embeddings."""
        if self.kind == "transformers":
            return int(self.model.config.projection_dim)
        return int(self.model.visual.output_dim)

    @property
    def logit_scale(self) -> float:
        """exp(learned logit scale): the temperature CLIP multiplies cosine similarities by."""
        return float(self.model.logit_scale.detach().float().exp())

    @torch.no_grad()
    def embed_images(self, frames: list[np.ndarray]) -> torch.Tensor:
        """RGB uint8 frames -> (N, D) unit-norm fp32 image embeddings."""
        if self.kind == "transformers":
            pixels = self.image_processor(images=list(frames), return_tensors="pt")["pixel_values"]
            features = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)).pooler_output
        else:
            from PIL import Image

            pixels = torch.stack([self.open_clip_preprocess(Image.fromarray(f)) for f in frames])
            features = self.model.encode_image(pixels.to(self.device, self.dtype))
        features = features.float()  # normalise in fp32: bf16 norms are coarse
        return features / features.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def embed_texts(self, texts: list[str]) -> torch.Tensor:
        """Prompts -> (N, D) unit-norm fp32 text embeddings (truncated to the model's context)."""
        if self.kind == "transformers":
            max_length = self.model.config.text_config.max_position_embeddings
            tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            features = self.model.get_text_features(
                input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device)
            ).pooler_output
        else:
            features = self.model.encode_text(self.open_clip_tokenizer(texts).to(self.device))
        features = features.float()
        return features / features.norm(dim=-1, keepdim=True)


def frames_with_owner(array: np.ndarray, frame_stride: int) -> tuple[list[np.ndarray], list[int]]:
    """Flattens a batch into frames (videos: every frame_stride-th) and the sample index of each."""
    frames, owners = [], []
    for index, sample in enumerate(array):
        for frame in sample_frames(sample, frame_stride):
            frames.append(frame)
            owners.append(index)
    return frames, owners


def mean_per_sample(values: torch.Tensor, owners: list[int], count: int) -> torch.Tensor:
    """Averages per-frame values (N,) into per-sample values (count,)."""
    index = torch.tensor(owners)
    sums = torch.zeros(count, dtype=torch.float32).index_add_(0, index, values.float().cpu())
    counts = torch.zeros(count, dtype=torch.float32).index_add_(0, index, torch.ones(len(owners)))
    return sums / counts
