"""WAV files read and written with Python's `wave` module and numpy (no audio library): the audio clips a prompt of
the autoregressive family plays (diffrl/models/causal_lm/audio.py turns them into the model's features), and the
waveforms an audio generator makes (the trajectory table stores them as WAV bytes, `diffrl sample` and MLflow write
.wav files). Standard library and numpy only, so the prompt loader checks a dataset's files without importing
transformers.

Supported: uncompressed PCM WAV, 16 bits a sample, any number of channels (read_wav averages them to mono,
decode_wav keeps them). Legend: S samples, C channels, T samples per channel.

16-bit PCM: a float sample x in [-1, 1] is stored as round(x * 32768) clipped to [-32768, 32767] and read back as
that integer / 32768, so a stored waveform is within 1 / 65536 of the generated one (+1.0 itself comes back as
32767 / 32768).
"""

from __future__ import annotations

import io
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


def encode_wav(waveform_CT: np.ndarray, sampling_rate: int) -> bytes:
    """A float waveform (C, T) in [-1, 1] (values outside are clipped) as the bytes of a 16-bit PCM WAV file."""
    waveform_CT = np.asarray(waveform_CT, dtype=np.float32)
    if waveform_CT.ndim != 2 or waveform_CT.shape[0] < 1:
        raise ValueError(f"a waveform to write is (channels, samples), got shape {tuple(waveform_CT.shape)}")
    if not np.isfinite(waveform_CT).all():
        raise ValueError("a waveform to write has non-finite samples")
    pcm_TC = np.clip(np.round(waveform_CT.T * 32768.0), -32768, 32767).astype("<i2")  # channels interleaved
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(waveform_CT.shape[0])
        f.setsampwidth(SAMPLE_WIDTH)
        f.setframerate(int(sampling_rate))
        f.writeframes(pcm_TC.tobytes())
    return buffer.getvalue()


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """(waveform float32 (C, T) in [-1, 1), sampling rate) of the bytes of a 16-bit PCM WAV file, channels kept."""
    try:
        with wave.open(io.BytesIO(data), "rb") as f:
            channels, width, rate, frames = f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()
            raw = f.readframes(frames)
    except (wave.Error, EOFError) as e:
        raise ValueError(f"not a PCM WAV file ({e})") from None
    if width != SAMPLE_WIDTH:
        raise ValueError(f"{8 * width}-bit samples; diffrl reads 16-bit PCM WAV only")
    samples = np.frombuffer(raw, dtype="<i2")
    if samples.size != frames * channels:
        raise ValueError(f"the WAV header names {frames} frames, the data holds fewer (truncated?)")
    return samples.reshape(frames, channels).T.astype(np.float32) / 32768.0, rate


def write_wav(path: str, waveform_CT: np.ndarray, sampling_rate: int) -> None:
    """Write a float waveform (C, T) in [-1, 1] to `path` as a 16-bit PCM WAV file."""
    with open(path, "wb") as f:
        f.write(encode_wav(waveform_CT, sampling_rate))
