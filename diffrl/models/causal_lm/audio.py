"""Audio inputs of the autoregressive family: the log-mel features of WAV clips (read by diffrl/models/wav.py) for the
Qwen3-Omni Thinker's audio tower (transformers' ``WhisperFeatureExtractor``, the feature extractor
``Qwen3OmniMoeProcessor`` runs) and the number of <|audio_pad|> tokens each clip becomes.

Legend: S samples, M mel bins (the extractor's feature_size), F feature frames (one per hop_length samples),
N clips.

Clips are taken at the extractor's sampling rate (16 kHz for Qwen3-Omni), not resampled: a clip at another rate is
a ValueError. A resampler simple enough to keep here (linear interpolation) aliases everything above the new Nyquist
frequency into the band when it downsamples (44.1 kHz -> 16 kHz folds 8-22 kHz into 0-8 kHz), so the model would
hear other audio than the processor's band-limited resampling gives it, silently; converting the file once is exact
and cheap.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

from diffrl.models.wav import CONVERT, read_wav

# Qwen3-Omni's preprocessor_config.json: Whisper log-mel features, 128 bins of 25 ms windows every 10 ms at 16 kHz.
# dither 0: the features of a clip are a function of the file (dither adds noise from the global RNG).
QWEN3_OMNI_FEATURES = {
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "padding_value": 0.0,
    "dither": 0.0,
    "return_attention_mask": True,
}


def load_clip(path: str, extractor: WhisperFeatureExtractor) -> np.ndarray:
    """A clip's waveform (S,) as the extractor takes it: at its sampling rate (not resampled: see the module
    docstring) and at least one STFT window (n_fft samples) long."""
    waveform, rate = read_wav(path)
    if rate != extractor.sampling_rate:
        raise ValueError(
            f"{path}: {rate} Hz audio; the model's feature extractor takes {extractor.sampling_rate} Hz and diffrl "
            f"does not resample: {CONVERT.format(rate=extractor.sampling_rate)}"
        )
    if waveform.shape[0] < extractor.n_fft:
        raise ValueError(
            f"{path}: {waveform.shape[0]} samples; a clip needs at least {extractor.n_fft} "
            f"({1000 * extractor.n_fft / rate:.0f} ms)"
        )
    return waveform


def feature_extractor(num_mel_bins: int = 128) -> WhisperFeatureExtractor:
    """Qwen3-Omni's feature extractor from its explicit settings (nothing is downloaded); num_mel_bins must be the
    audio tower's (audio_config.num_mel_bins)."""
    return WhisperFeatureExtractor(**{**QWEN3_OMNI_FEATURES, "feature_size": num_mel_bins})


def audio_tokens(frames: torch.Tensor, n_window: int) -> torch.Tensor:
    """<|audio_pad|> tokens of clips of `frames` feature frames each: the audio tower's output length, by the same
    function the processor and the model's M-RoPE index use (so the placeholders and the tower's output agree)."""
    return _get_feat_extract_output_lengths(frames, n_window)


def audio_features(extractor: WhisperFeatureExtractor, paths: list[str], n_window: int) -> dict[str, torch.Tensor]:
    """The Thinker's audio inputs of N clips: input_features (N, M, F) zero-padded to the longest clip,
    feature_attention_mask (N, F) (1 on each clip's frames), audio_tokens (N,) placeholders per clip.

    Each clip is featurized alone and padded here, not by the extractor in one batch: the extractor's padding is of
    the waveform, and its STFT's last frames and valid-frame count then depend on the other clips of the batch. Alone,
    a clip's features are the same in the rollout's batch and in the trainer's micro-batch."""
    features = [  # (M, F_i) each; "longest" padding of one clip pads nothing (its default pads to 300 s)
        extractor(
            load_clip(p, extractor),
            sampling_rate=extractor.sampling_rate,
            padding="longest",
            truncation=False,
            return_tensors="pt",
        )["input_features"][0]
        for p in paths
    ]
    frames = torch.tensor([f.shape[1] for f in features], dtype=torch.long)
    width = int(frames.max())
    input_features = torch.zeros((len(paths), extractor.feature_size, width), dtype=torch.float32)
    mask = torch.zeros((len(paths), width), dtype=torch.long)
    for i, f in enumerate(features):
        input_features[i, :, : f.shape[1]], mask[i, : f.shape[1]] = f, 1
    return {
        "input_features": input_features,
        "feature_attention_mask": mask,
        "audio_tokens": audio_tokens(frames, n_window),
    }
