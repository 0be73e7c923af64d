"""WAV reading (diffrl.models.wav) with the standard library: a written sine reads back as its closed form, and every
file it cannot read is a ValueError naming the file and what to do."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from diffrl.models.wav import decode_wav, encode_wav, read_wav, wav_info, write_wav


def _write(path, samples: np.ndarray, *, rate: int = 16000, width: int = 2) -> str:
    """samples (S, C) as a PCM WAV of `width` bytes a sample."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(samples.shape[1])
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(np.ascontiguousarray(samples).tobytes())
    return str(path)


def test_a_sine_reads_back_as_its_closed_form(tmp_path):
    rate, n = 16000, 1600
    t = np.arange(n) / rate
    left, right = 0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.cos(2 * np.pi * 1000 * t)
    mono = _write(tmp_path / "mono.wav", np.round(left * 32767).astype("<i2")[:, None], rate=rate)
    waveform, got_rate = read_wav(mono)
    assert got_rate == rate and waveform.dtype == np.float32 and waveform.shape == (n,)
    # int16 rounding: within half a step of 1/32768 of the closed form (scaled by 32767/32768)
    np.testing.assert_allclose(waveform, left * 32767 / 32768, rtol=0, atol=0.5 / 32768 + 1e-7)

    stereo = _write(tmp_path / "stereo.wav", np.round(np.stack([left, right], 1) * 32767).astype("<i2"), rate=rate)
    waveform, _ = read_wav(stereo)
    assert waveform.shape == (n,)  # the channels' mean
    np.testing.assert_allclose(waveform, (left + right) / 2 * 32767 / 32768, rtol=0, atol=0.5 / 32768 + 1e-7)
    assert wav_info(stereo).channels == 2 and wav_info(stereo).frames == n


def test_unreadable_files_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="gone.wav: audio file does not exist"):
        wav_info(str(tmp_path / "gone.wav"))
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    with pytest.raises(ValueError, match="notes.wav: not a PCM WAV file"):
        wav_info(str(text))
    eight_bit = _write(tmp_path / "u8.wav", np.full((100, 1), 128, np.uint8), width=1)
    with pytest.raises(ValueError, match=r"u8.wav: 8-bit samples; diffrl reads 16-bit PCM WAV only: ffmpeg"):
        read_wav(eight_bit)
    # a float WAV (format tag 3 in the fmt chunk) is not PCM
    good = _write(tmp_path / "float.wav", np.zeros((100, 1), "<i2"))
    raw = bytearray(open(good, "rb").read())
    raw[20:22] = (3).to_bytes(2, "little")
    open(good, "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="float.wav: not a PCM WAV file .*unknown format: 3"):
        read_wav(good)
    cut = _write(tmp_path / "cut.wav", np.zeros((1000, 1), "<i2"))
    open(cut, "r+b").truncate(44 + 500)  # the header still names 1000 frames
    with pytest.raises(ValueError, match="cut.wav: the WAV header names 1000 frames"):
        read_wav(cut)


def test_written_waveforms_read_back_within_half_a_step(tmp_path):
    rate, n = 8000, 800
    t = np.arange(n) / rate
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), np.full(n, 1.0)]).astype(np.float32)
    data = encode_wav(stereo, rate)
    waveform, got_rate = decode_wav(data)
    assert got_rate == rate and waveform.shape == (2, n) and waveform.dtype == np.float32
    np.testing.assert_allclose(waveform[0], stereo[0], rtol=0, atol=0.5 / 32768 + 1e-7)
    assert (waveform[1] == 32767 / 32768).all()  # +1.0 is clipped to the largest 16-bit sample
    path = str(tmp_path / "clip.wav")
    write_wav(path, stereo, rate)
    assert wav_info(path).channels == 2 and read_wav(path)[0].shape == (n,)  # the WAV reader's own view
    with pytest.raises(ValueError, match="non-finite"):
        encode_wav(np.array([[np.nan]], dtype=np.float32), rate)
    with pytest.raises(ValueError, match="not a PCM WAV"):
        decode_wav(b"not a wav file")
