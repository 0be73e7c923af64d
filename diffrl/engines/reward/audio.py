"""Rule rewards on the waveform: loudness, silence and spectral-centroid targets.

Legend: C = channels, T = samples, N = analysis frames. A batch arrives as an AudioBatch (base.py): float32
(B, C, T) in [-1, 1] with its sample rate. Each rule is a pure function of one sample's waveform; the score is
`target_score` of its distance to the configured target:

    score = exp(-max(0, distance - tolerance) / falloff)     in (0, 1], 1 within the tolerance

(smooth outside the tolerance, so a group of samples all off target still ranks by how far off each is).
- audio_loudness: distance = |RMS dBFS - target_dbfs| in dB. RMS over every channel and sample, 20 log10(RMS), so a
  full-scale sine is -3.01 dBFS; digital silence is SILENCE_FLOOR_DBFS.
- audio_silence: distance = |silence fraction - target_fraction|; the fraction of `frame_ms` frames (a trailing
  partial frame is dropped) whose RMS dBFS is below `threshold_dbfs`. All-zero audio has fraction 1.
- audio_spectral_centroid: distance = |log2(centroid / target_hz)| in octaves; the centroid is sum(f |X(f)|) /
  sum(|X(f)|) of the magnitude spectrum averaged over Hann-windowed frames of `n_fft` (hop n_fft / 2) and channels.
A sample that cannot be measured (no samples, a non-finite sample, no energy for the centroid) is excluded: valid
False, score NaN, the reason in info["error"].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from diffrl.engines.reward.base import RewardOutput, check_positive, register_reward, to_audio

SILENCE_FLOOR_DBFS = -120.0  # the level of digital silence: below 16-bit PCM's -96 dB range, so always finite


def rms_dbfs(waveform_CT: np.ndarray) -> float:
    """RMS level in dB relative to full scale: 20 log10(sqrt(mean(x^2))), floored at SILENCE_FLOOR_DBFS."""
    rms = float(np.sqrt(np.mean(np.square(waveform_CT, dtype=np.float64))))
    return max(20.0 * math.log10(rms), SILENCE_FLOOR_DBFS) if rms > 0 else SILENCE_FLOOR_DBFS


def silence_fraction(waveform_CT: np.ndarray, sample_rate: int, frame_ms: float, threshold_dbfs: float) -> float:
    """The fraction of frames of `frame_ms` whose RMS dBFS (all channels) is below `threshold_dbfs`; a clip shorter
    than one frame is one frame."""
    frame = max(1, round(sample_rate * frame_ms / 1000.0))
    count = max(1, waveform_CT.shape[-1] // frame)
    usable = waveform_CT[:, : count * frame] if waveform_CT.shape[-1] >= frame else waveform_CT
    frames_CNL = usable.reshape(usable.shape[0], count, -1)
    levels = [rms_dbfs(frames_CNL[:, n]) for n in range(count)]
    return float(np.mean(np.asarray(levels) < threshold_dbfs))


def spectral_centroid(waveform_CT: np.ndarray, sample_rate: int, n_fft: int) -> float:
    """sum(f |X(f)|) / sum(|X(f)|) in Hz over the magnitude spectrum averaged over Hann frames (hop n_fft / 2) and
    channels; a clip shorter than n_fft is zero-padded to one frame. NaN when the spectrum has no energy."""
    signal = np.asarray(waveform_CT, dtype=np.float64)
    if signal.shape[-1] < n_fft:
        signal = np.pad(signal, ((0, 0), (0, n_fft - signal.shape[-1])))
    frames_CNL = np.lib.stride_tricks.sliding_window_view(signal, n_fft, axis=-1)[:, :: n_fft // 2]
    magnitude = np.abs(np.fft.rfft(frames_CNL * np.hanning(n_fft), axis=-1)).mean(axis=(0, 1))
    total = float(magnitude.sum())
    if total <= 0:
        return math.nan
    return float((np.fft.rfftfreq(n_fft, 1.0 / sample_rate) * magnitude).sum() / total)


def target_score(distance: float, tolerance: float, falloff: float) -> float:
    """exp(-max(0, distance - tolerance) / falloff): 1 within the tolerance, 1/e at `falloff` beyond it."""
    return math.exp(-max(0.0, distance - tolerance) / falloff)


def audio_problem(waveform_CT: np.ndarray) -> str:
    """Why a sample's waveform cannot be scored ('' when it can): no samples, or a non-finite sample."""
    if waveform_CT.shape[-1] == 0:
        return "empty audio (0 samples)"
    if not np.isfinite(waveform_CT).all():
        return "non-finite audio samples"
    return ""


@dataclass
class AudioRuleReward:
    """A rule: `measure(waveform_CT, sample_rate)` -> a value (NaN: unmeasurable), `distance(value)` to the target,
    scored by target_score. info[info_key] holds the measured values, info["error"] why a sample was excluded."""

    name: str
    measure: Callable[[np.ndarray, int], float]
    distance: Callable[[float], float]
    tolerance: float
    falloff: float
    info_key: str
    batch_size: int

    def __call__(self, samples, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        batch = to_audio(samples, self.name)
        scores, values, errors = [], [], []
        for waveform in batch.waveform:
            problem = audio_problem(waveform)
            value = math.nan if problem else self.measure(waveform, batch.sample_rate)
            if not problem and not math.isfinite(value):
                problem = f"{self.info_key} is undefined (no signal energy)"
            scores.append(None if problem else target_score(self.distance(value), self.tolerance, self.falloff))
            values.append(value)
            errors.append(problem)
        return RewardOutput.from_lists(scores, info={self.info_key: values, "error": errors})


def _check_target(owner: str, options, tolerance: str, falloff: str) -> None:
    check_positive(getattr(options, tolerance), tolerance, owner, allow_zero=True)
    check_positive(getattr(options, falloff), falloff, owner)
    check_positive(options.batch_size, "batch_size", owner)


@dataclass
class LoudnessOptions:
    """target_dbfs: the RMS level wanted (dBFS); tolerance_db: no penalty within it; falloff_db: 1/e beyond it."""

    target_dbfs: float = -20.0
    tolerance_db: float = 2.0
    falloff_db: float = 6.0
    batch_size: int = 64

    def __post_init__(self):
        _check_target("audio_loudness", self, "tolerance_db", "falloff_db")


@dataclass
class SilenceOptions:
    """target_fraction: the share of silent frames wanted (0..1); a frame of frame_ms is silent below
    threshold_dbfs."""

    target_fraction: float = 0.0
    tolerance: float = 0.1
    falloff: float = 0.2
    frame_ms: float = 20.0
    threshold_dbfs: float = -60.0
    batch_size: int = 64

    def __post_init__(self):
        if not 0.0 <= self.target_fraction <= 1.0:
            raise ValueError(f"audio_silence: option 'target_fraction' must be in [0, 1], got {self.target_fraction}")
        check_positive(self.frame_ms, "frame_ms", "audio_silence")
        _check_target("audio_silence", self, "tolerance", "falloff")


@dataclass
class CentroidOptions:
    """target_hz: the spectral centroid wanted; tolerance/falloff in octaves; n_fft: the analysis frame (samples)."""

    target_hz: float = 2000.0
    tolerance_octaves: float = 0.5
    falloff_octaves: float = 1.0
    n_fft: int = 2048
    batch_size: int = 64

    def __post_init__(self):
        check_positive(self.target_hz, "target_hz", "audio_spectral_centroid")
        if self.n_fft < 2:
            raise ValueError(f"audio_spectral_centroid: option 'n_fft' must be >= 2, got {self.n_fft}")
        _check_target("audio_spectral_centroid", self, "tolerance_octaves", "falloff_octaves")


@register_reward("audio_loudness", options=LoudnessOptions)
def audio_loudness(options: LoudnessOptions) -> AudioRuleReward:
    """RMS loudness (dBFS) against a target with a tolerance."""
    return AudioRuleReward(
        name="audio_loudness",
        measure=lambda waveform, _rate: rms_dbfs(waveform),
        distance=lambda level: abs(level - options.target_dbfs),
        tolerance=options.tolerance_db,
        falloff=options.falloff_db,
        info_key="rms_dbfs",
        batch_size=options.batch_size,
    )


@register_reward("audio_silence", options=SilenceOptions)
def audio_silence(options: SilenceOptions) -> AudioRuleReward:
    """The fraction of silent frames against a target with a tolerance."""
    return AudioRuleReward(
        name="audio_silence",
        measure=lambda waveform, rate: silence_fraction(waveform, rate, options.frame_ms, options.threshold_dbfs),
        distance=lambda fraction: abs(fraction - options.target_fraction),
        tolerance=options.tolerance,
        falloff=options.falloff,
        info_key="silence_fraction",
        batch_size=options.batch_size,
    )


@register_reward("audio_spectral_centroid", options=CentroidOptions)
def audio_spectral_centroid(options: CentroidOptions) -> AudioRuleReward:
    """The spectral centroid (Hz) against a target, compared in octaves."""
    return AudioRuleReward(
        name="audio_spectral_centroid",
        measure=lambda waveform, rate: spectral_centroid(waveform, rate, options.n_fft),
        distance=lambda hz: abs(math.log2(hz / options.target_hz)) if hz > 0 else math.inf,
        tolerance=options.tolerance_octaves,
        falloff=options.falloff_octaves,
        info_key="centroid_hz",
        batch_size=options.batch_size,
    )
