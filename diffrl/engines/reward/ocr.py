"""OCR reward (the text-rendering reward of Flow-GRPO, Liu et al., 2025), with RapidOCR.

Target text = metadata["ground_truth"] if present, else the text inside the first pair of double
quotes in the prompt. The recognised text is every detected line joined in reading order.
Both are lowercased with whitespace removed; score 1 if the target is a substring of the
recognised text, else 1 - min(Levenshtein, len(target)) / len(target). Videos: every
`frame_stride`-th frame (default 4), averaged.

Deviation from Flow-GRPO: it uses PaddleOCR; we use rapidocr-onnxruntime, which runs the same
PP-OCRv4 detection/recognition models through onnxruntime and ships them inside the wheel (no
download). A prompt with no quoted text and no ground truth is a ValueError (a data error).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from diffrl.engines.reward.base import RewardOutput, check_positive, register_reward, sample_frames, to_uint8_numpy
from diffrl.engines.reward.text import target_text, text_similarity

logger = logging.getLogger(__name__)


@dataclass
class OcrOptions:
    """num_threads: onnxruntime intra-op threads per engine (-1 = all cores; set 1 when running
    several pool workers on few cores). min_confidence: drop recognised lines below it."""

    frame_stride: int = 4
    batch_size: int = 16
    num_threads: int = -1
    min_confidence: float = 0.5

    def __post_init__(self):
        check_positive(self.frame_stride, "frame_stride", "ocr")
        check_positive(self.batch_size, "batch_size", "ocr")
        if self.num_threads == 0 or self.num_threads < -1:
            raise ValueError(f"ocr: option 'num_threads' must be -1 (all cores) or >= 1, got {self.num_threads}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"ocr: option 'min_confidence' must be in [0, 1], got {self.min_confidence}")


class OcrReward:
    """Owns one RapidOCR engine (three onnxruntime sessions, ~0.4 s to load on a laptop CPU)."""

    name = "ocr"

    def __init__(self, options: OcrOptions):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:  # an extra: the quickstart's install leaves its ~380 MB out
            raise ValueError(f"reward 'ocr' needs rapidocr-onnxruntime ({e}): pip install 'diffrl[ocr]'") from None

        self.options = options
        self.batch_size = options.batch_size
        self.engine = RapidOCR(
            intra_op_num_threads=options.num_threads,
            inter_op_num_threads=options.num_threads,
            text_score=options.min_confidence,
        )

    def recognise(self, image_HW3: np.ndarray) -> str:
        """All text lines RapidOCR finds in an RGB uint8 image, joined by spaces ('' if none)."""
        # RapidOCR treats a 3-channel ndarray as BGR (OpenCV order); ours are RGB.
        result, _ = self.engine(np.ascontiguousarray(image_HW3[..., ::-1]))
        if not result:
            return ""
        return " ".join(str(line[1]) for line in result)

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        array = to_uint8_numpy(images)
        if not len(array) == len(prompts) == len(metadata):
            raise ValueError(f"ocr: got {len(array)} images, {len(prompts)} prompts, {len(metadata)} metadata")
        scores, recognised_texts, targets = [], [], []
        for index, (sample, prompt, meta) in enumerate(zip(array, prompts, metadata)):
            target = target_text(prompt, meta)
            if target is None:
                raise ValueError(
                    f"ocr: sample {index} has no target text: no metadata['ground_truth'] and no "
                    f'"quoted text" in the prompt {prompt!r}'
                )
            frame_texts = [self.recognise(frame) for frame in sample_frames(sample, self.options.frame_stride)]
            scores.append(float(np.mean([text_similarity(target, text) for text in frame_texts])))
            recognised_texts.append(" | ".join(frame_texts))
            targets.append(target)
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            valid=torch.ones(len(scores), dtype=torch.bool),
            info={"recognised": recognised_texts, "target": targets},
        )


@register_reward("ocr", options=OcrOptions)
def ocr(options: OcrOptions) -> OcrReward:
    """Real OCR with rapidocr-onnxruntime (models shipped inside the wheel)."""
    return OcrReward(options)
