"""WAV files read with Python's `wave` module and numpy (no audio library): the audio clips a prompt of the
autoregressive family plays (diffrl/models/causal_lm/audio.py turns them into the model's features). Standard library
and numpy only, so the prompt loader checks a dataset's files without importing transformers.

Supported: uncompressed PCM WAV, 16 bits a sample, any number of channels (averaged to mono). Legend: S samples.
"""

from __future__ import annotations

import os
import wave
from dataclasses import dataclass

import numpy as np

SAMPLE_WIDTH = 2  # bytes a sample: 16-bit PCM
CONVERT = "ffmpeg -i IN -ac 1 -ar {rate} -c:a pcm_s16le OUT.wav"  # how a user gets a file this module reads


@dataclass(frozen=True)
class WavInfo:
    """A WAV file's header: channels, sampling_rate (Hz), frames (samples per channel)."""

    path: str
    channels: int
    sampling_rate: int
    frames: int


def wav_info(path: str) -> WavInfo:
    """The header of a 16-bit PCM WAV file (nothing past it is read); ValueError naming the file when it is missing,
    not a WAV, compressed or of another sample width."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: audio file does not exist")
    try:
        with wave.open(path, "rb") as f:
            channels, width, rate, frames = f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()
    except (wave.Error, EOFError) as e:
        # wave.Error also for a WAV in another encoding than PCM (float, A-law, ...): "unknown format: 3"
        raise ValueError(f"{path}: not a PCM WAV file ({e}); convert it: {CONVERT.format(rate=16000)}") from None
    if width != SAMPLE_WIDTH:
        raise ValueError(
            f"{path}: {8 * width}-bit samples; diffrl reads 16-bit PCM WAV only: {CONVERT.format(rate=rate)}"
        )
    return WavInfo(path, channels, rate, frames)


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """(waveform float32 (S,) in [-1, 1), sampling rate): a 16-bit PCM WAV, its channels averaged to mono."""
    info = wav_info(path)
    with wave.open(path, "rb") as f:
        raw = f.readframes(info.frames)
    samples = np.frombuffer(raw, dtype="<i2")  # WAV stores little-endian samples, channels interleaved
    if samples.size != info.frames * info.channels:
        raise ValueError(f"{path}: the WAV header names {info.frames} frames, the file holds fewer (truncated?)")
    waveform = samples.reshape(info.frames, info.channels).astype(np.float32).mean(axis=1) / 32768.0
    return waveform, info.sampling_rate
