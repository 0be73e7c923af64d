"""The http_scorer reward against a real HTTP server on loopback (the scripted server of
conftest.py, standing in for a user's scoring service)."""

import io
import json
import wave

import numpy as np
import pytest
from PIL import Image

from diffrl.engines.reward.base import AudioBatch, RewardError, build_reward

FAST = {"timeout_s": 1.0, "retries": 1, "backoff_s": 0.01}


def _field(body: bytes, name: str) -> bytes:
    """The raw value of one multipart form field."""
    marker = f'name="{name}"'.encode()
    part = body[body.index(marker) :]
    value = part[part.index(b"\r\n\r\n") + 4 :]
    return value[: value.index(b"\r\n--")]


def test_posts_image_prompt_metadata_and_reads_the_score(scripted_server):
    def respond(path, headers, body):
        image = np.asarray(Image.open(io.BytesIO(_field(body, "image"))))
        return 200, {"score": float(image.mean()) / 255 + len(_field(body, "prompt"))}, 0

    server = scripted_server(respond)
    images = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    reward = build_reward("http_scorer", {"url": server.url + "/score", **FAST})
    out = reward(images, ["ab", "abcd"], [{"ground_truth": "x"}, {}])
    expected = [images[0].mean() / 255 + 2, images[1].mean() / 255 + 4]
    assert out.scores.tolist() == pytest.approx(expected, rel=1e-6)
    assert json.loads(_field(server.requests[0]["body"], "metadata")) in ({"ground_truth": "x"}, {})


def test_reply_without_a_number_excludes_the_sample(scripted_server):
    replies = iter([{"score": 0.5}, {"score": "high"}, {"result": 1}])
    server = scripted_server(lambda path, headers, body: (200, next(replies), 0))
    reward = build_reward("http_scorer", {"url": server.url, "concurrency": 1, **FAST})
    out = reward(np.zeros((3, 8, 8, 3), dtype=np.uint8), ["a", "b", "c"], [{}, {}, {}])
    assert out.valid.tolist() == [True, False, False]
    assert out.scores[0].item() == 0.5 and np.isnan(out.scores[1:].numpy()).all()
    assert out.info["error"][1].startswith("malformed")


def test_server_error_raises_after_retries(scripted_server):
    server = scripted_server(lambda path, headers, body: (500, {"error": "boom"}, 0))
    reward = build_reward("http_scorer", {"url": server.url, **FAST})
    with pytest.raises(RewardError, match="failed after 2 attempts; last error: HTTP 500"):
        reward(np.zeros((1, 8, 8, 3), dtype=np.uint8), ["a"], [{}])
    assert len(server.requests) == 2


def test_audio_scorer_posts_each_clip_as_a_wav_file(scripted_server):
    """http_audio_scorer: one request per clip, the WAV keeps channels and sample rate; a clip that cannot be sent
    (non-finite) is excluded without a request."""

    def respond(path, headers, body):
        with wave.open(io.BytesIO(_field(body, "audio")), "rb") as f:
            pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, f.getnchannels())
            rate = f.getframerate()
        return 200, {"loud": float(np.abs(pcm).max()) / 32767 + rate / 1e6 + pcm.shape[1]}, 0

    server = scripted_server(respond)
    waveform = np.zeros((3, 2, 400), dtype=np.float32)
    waveform[0, 1, 7] = 0.5
    waveform[1, 0, 3] = -2.0  # clipped to full scale
    waveform[2, 0, 0] = np.inf
    reward = build_reward("http_audio_scorer", {"url": server.url, "score_key": "loud", **FAST})
    out = reward(AudioBatch(waveform, 8000), ["ab", "c", "d"], [{}, {}, {}])
    assert out.scores[:2].tolist() == pytest.approx([round(0.5 * 32767) / 32767 + 2.008, 1 + 2.008], rel=1e-6)
    assert out.valid.tolist() == [True, True, False] and out.info["error"][2] == "not sent: non-finite audio samples"
    assert len(server.requests) == 2 and {_field(r["body"], "prompt") for r in server.requests} == {b"ab", b"c"}
    with pytest.raises(TypeError, match="http_audio_scorer scores audio"):
        reward(np.zeros((1, 8, 8, 3), dtype=np.uint8), ["a"], [{}])
