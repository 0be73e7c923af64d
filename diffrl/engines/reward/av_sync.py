"""Audio-video synchrony of a video with its audio track (LTX-2): the lag between sound events and visual changes.

Legend: F = video frames, C = audio channels, T = audio samples, N = frames both streams cover.
Both streams become one value per video frame f (the first N = min(F, floor(T * fps / sample_rate)) frames):
    video change v[f] = mean |x[f] - x[f-1]| / 255            (v[0] = 0)
    audio change a[f] = |e[f] - e[f-1]|                         (a[0] = 0)
where e[f] is the RMS of the audio samples during frame f, [round(f sr / fps), round((f+1) sr / fps)). Taking the
change of the audio energy makes a click and a one-frame flash the same shape (a rise and a fall). With v and a
standardised (zero mean, unit std over the N frames), the lag is

    lag = argmax_{|l| <= L} mean_f v[f] a[f + l]               (over the frames both cover; ties: the smaller |l|)

positive when the audio comes late, and the score is 1 - |lag| / L in [0, 1], with L = max(1, round(max_lag_s *
fps)) capped at N // 2 (so that every lag compares at least half the frames). info: lag_frames, lag_s, correlation
(the mean product at the lag). A sample without any visual change or any change of audio energy has no lag to find:
excluded (valid False, NaN), as are empty or non-finite audio and clips under 4 frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from diffrl.engines.reward.audio import audio_problem
from diffrl.engines.reward.base import AudioBatch, RewardOutput, check_positive, register_reward, to_audio

MIN_FRAMES = 4


def video_change(video_FHW3: np.ndarray) -> np.ndarray:
    """v (F,): v[0] = 0, v[f] = mean |x[f] - x[f-1]| / 255."""
    change = np.zeros(len(video_FHW3))
    for f in range(1, len(video_FHW3)):
        change[f] = np.abs(video_FHW3[f].astype(np.int16) - video_FHW3[f - 1].astype(np.int16)).mean() / 255.0
    return change


def audio_change(waveform_CT: np.ndarray, sample_rate: int, fps: float, frames: int) -> np.ndarray:
    """a (frames,): a[0] = 0, a[f] = |e[f] - e[f-1]| with e[f] the RMS of the samples during video frame f."""
    bounds = [round(f * sample_rate / fps) for f in range(frames + 1)]
    windows = [waveform_CT[:, bounds[f] : bounds[f + 1]] for f in range(frames)]
    energy = np.array([np.sqrt(np.mean(np.square(window, dtype=np.float64))) for window in windows])
    return np.concatenate([[0.0], np.abs(np.diff(energy))])


def best_lag(video_N: np.ndarray, audio_N: np.ndarray, max_lag: int) -> tuple[int, float]:
    """(the lag l in [-max_lag, max_lag] maximising mean_f v[f] a[f + l] of the standardised envelopes, that mean);
    among equal means the smallest |l| wins, then the negative one."""
    v = (video_N - video_N.mean()) / video_N.std()
    a = (audio_N - audio_N.mean()) / audio_N.std()
    n = len(v)
    best, best_corr = 0, -math.inf
    for lag in sorted(range(-max_lag, max_lag + 1), key=lambda x: (abs(x), x)):
        corr = float(np.mean(v[max(0, -lag) : n - max(0, lag)] * a[max(0, lag) : n - max(0, -lag)]))
        if corr > best_corr + 1e-12:
            best, best_corr = lag, corr
    return best, best_corr


def sync_lag(video_FHW3: np.ndarray, waveform_CT: np.ndarray, sample_rate: int, fps: float, max_lag_s: float):
    """(lag in frames, correlation, L) of one sample, or (None, reason, 0) when it has no lag to find."""
    problem = audio_problem(waveform_CT)
    frames = min(len(video_FHW3), math.floor(waveform_CT.shape[-1] * fps / sample_rate))
    if problem or frames < MIN_FRAMES:
        return None, problem or f"{frames} frames covered by both streams, fewer than {MIN_FRAMES}", 0
    video = video_change(video_FHW3[:frames])
    audio = audio_change(waveform_CT, sample_rate, fps, frames)
    if not video.std() > 0:
        return None, "no visual change between frames", 0
    if not audio.std() > 0:
        return None, "no change of audio energy", 0
    max_lag = min(max(1, round(max_lag_s * fps)), frames // 2)
    lag, corr = best_lag(video, audio, max_lag)
    return lag, corr, max_lag


@dataclass
class AvSyncOptions:
    """max_lag_s: the largest offset searched (seconds), where the score reaches 0."""

    max_lag_s: float = 0.5
    batch_size: int = 16

    def __post_init__(self):
        check_positive(self.max_lag_s, "max_lag_s", "av_sync")
        check_positive(self.batch_size, "batch_size", "av_sync")


@dataclass
class AvSyncReward:
    """Holds the options only (a dataclass to satisfy RewardFunction)."""

    options: AvSyncOptions
    name: str = "av_sync"

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    def __call__(self, samples, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        batch: AudioBatch = to_audio(samples, self.name)
        if batch.video is None:
            raise TypeError("av_sync scores a video with its audio track; the batch is audio without video")
        scores, info = [], {"lag_frames": [], "lag_s": [], "correlation": [], "error": []}
        for video, waveform in zip(batch.video, batch.waveform):
            lag, corr, max_lag = sync_lag(video, waveform, batch.sample_rate, batch.fps, self.options.max_lag_s)
            scores.append(None if lag is None else 1.0 - abs(lag) / max_lag)
            info["lag_frames"].append(lag)
            info["lag_s"].append(None if lag is None else lag / batch.fps)
            info["correlation"].append(None if lag is None else corr)
            info["error"].append(corr if lag is None else "")
        return RewardOutput.from_lists(scores, info=info)


@register_reward("av_sync", options=AvSyncOptions)
def av_sync(options: AvSyncOptions) -> AvSyncReward:
    """1 - |lag| / max lag between audio-energy changes and visual changes."""
    return AvSyncReward(options)
