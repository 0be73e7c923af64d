"""The VLM judge against a real HTTP server on loopback (the scripted server of conftest.py,
standing in for a vLLM / SGLang / transformers-serve VLM that cannot run on this machine)."""

import base64
import io
import json
import time

import numpy as np
import pytest
from PIL import Image

from diffrl.configs.reward import RewardComponent, RewardConfig
from diffrl.engines.reward.base import RewardError, build_reward
from diffrl.engines.reward.multi import MultiReward, reward_metrics
from diffrl.engines.reward.vlm_judge import parse_rating

FAST = {"timeout_s": 1.0, "retries": 2, "backoff_s": 0.01}


def chat_answer(content) -> dict:
    """An OpenAI chat-completions response body carrying `content`."""
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
    }


def _images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 16, 16, 3), dtype=np.uint8)


def test_rating_parser():
    assert parse_rating("5") == 1.0
    assert parse_rating("Rating: 4/5") == 0.75
    assert parse_rating("I'd say 2.5.") == pytest.approx(0.375)
    for malformed in ("10", "six", "0", "", "5.5 stars", "rating 6, maybe 4"):
        with pytest.raises(ValueError):
            parse_rating(malformed)


def test_request_format_and_rating_scores(scripted_server, monkeypatch):
    answers = iter(["4", "Rating: 2"])
    server = scripted_server(lambda path, headers, body: (200, chat_answer(next(answers)), 0))
    monkeypatch.setenv("TEST_JUDGE_KEY", "secret-key")
    reward = build_reward(
        "vlm_judge",
        {"base_url": server.url + "/v1", "model": "judge", "api_key_env": "TEST_JUDGE_KEY", "concurrency": 1, **FAST},
    )
    images = _images(2)
    out = reward(images, ["a red cat", "a dog"], [{}, {}])
    assert out.valid.tolist() == [True, True]
    assert out.scores.tolist() == [0.75, 0.25]
    assert out.info["answer"] == ["4", "Rating: 2"]
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer secret-key"
    body = json.loads(request["body"])
    assert body["model"] == "judge"
    image_part, text_part = body["messages"][0]["content"]
    assert 'description "a red cat"' in text_part["text"]
    prefix = "data:image/png;base64,"
    assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith(prefix)
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(image_part["image_url"]["url"][len(prefix) :]))))
    assert np.array_equal(decoded, images[0])  # PNG is lossless


def test_ocr_parser_scores_the_transcription(scripted_server):
    server = scripted_server(lambda path, headers, body: (200, chat_answer("HIDDEN TRAIL"), 0))
    reward = build_reward("vlm_judge", {"base_url": server.url + "/v1", "model": "m", "parser": "ocr", **FAST})
    out = reward(_images(2), ['a sign "Hidden Trail"', "a sign"], [{}, {"ground_truth": "Hidden Tale"}])
    assert out.scores[0].item() == 1.0
    assert out.scores[1].item() == pytest.approx(1 - 3 / 10)  # hiddentale vs hiddentrail: 3 edits


def test_malformed_answer_is_an_excluded_counted_sample(scripted_server):
    answers = {"a": chat_answer("5"), "b": chat_answer("I cannot rate this"), "c": {"unexpected": True}}
    server = scripted_server(
        lambda path, headers, body: (200, answers[json.loads(body)["messages"][0]["content"][1]["text"][-1]], 0)
    )
    template = "{prompt}"  # the prompt alone, so the server can tell the samples apart
    config = RewardConfig(
        components=[
            RewardComponent(
                "vlm_judge",
                weight=2.0,
                options={"base_url": server.url, "model": "m", "prompt_template": template, **FAST},
            ),
            RewardComponent("jpeg_compressibility", weight=1.0),
        ]
    )
    out = MultiReward(config)(_images(3), ["a", "b", "c"], None)
    assert out.valid.tolist() == [True, False, False]
    assert np.isnan(out.scores[1:].numpy()).all()  # excluded samples are NaN, never 0
    assert out.info["excluded"] == [False, True, True]
    assert out.info["excluded_by"] == [[], ["vlm_judge"], ["vlm_judge"]]
    assert out.scores[0].item() == pytest.approx(2.0 * 1.0 + out.info["jpeg_compressibility"][0], rel=1e-6)
    metrics = reward_metrics(out, ["vlm_judge", "jpeg_compressibility"])
    assert metrics["reward/excluded"] == 2 and metrics["reward/vlm_judge"] == 1.0
    assert len(server.requests) == 3  # malformed answers are not retried


def test_server_down_fails_after_the_retries():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reward = build_reward("vlm_judge", {"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", **FAST})
    with pytest.raises(RewardError, match=r"failed after 3 attempts; last error: ConnectionRefusedError"):
        reward(_images(1), ["x"], [{}])


def test_slow_answer_times_out_after_the_retries(scripted_server):
    server = scripted_server(lambda path, headers, body: (200, chat_answer("5"), 1.0))
    reward = build_reward(
        "vlm_judge", {"base_url": server.url, "model": "m", "timeout_s": 0.2, "retries": 1, "backoff_s": 0.01}
    )
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"failed after 2 attempts; last error: no complete answer within 0.2 s"):
        reward(_images(1), ["x"], [{}])
    assert time.monotonic() - started < 5.0
    assert len(server.requests) == 2


def test_transient_errors_are_retried_client_errors_are_not(scripted_server):
    statuses = iter([503, 429, 200])
    server = scripted_server(
        lambda path, headers, body: (s := next(statuses), chat_answer("3") if s == 200 else {"error": "busy"}, 0)
    )
    reward = build_reward("vlm_judge", {"base_url": server.url, "model": "m", **FAST})
    assert reward(_images(1), ["x"], [{}]).scores.tolist() == [0.5]
    assert len(server.requests) == 3
    bad = scripted_server(lambda path, headers, body: (400, {"error": "no such model"}, 0))
    reward = build_reward("vlm_judge", {"base_url": bad.url, "model": "m", **FAST})
    with pytest.raises(RewardError, match="HTTP 400.*no such model"):
        reward(_images(1), ["x"], [{}])
    assert len(bad.requests) == 1


def test_start_up_checks(monkeypatch):
    monkeypatch.delenv("UNSET_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="'UNSET_JUDGE_KEY'.*not set"):
        build_reward("vlm_judge", {"base_url": "http://127.0.0.1:1", "model": "m", "api_key_env": "UNSET_JUDGE_KEY"})
    with pytest.raises(ValueError, match="'parser' must be one of ocr, rating"):
        build_reward("vlm_judge", {"base_url": "http://127.0.0.1:1", "model": "m", "parser": "stars"})


def test_input_image_goes_first_for_editing(scripted_server, tmp_path):
    server = scripted_server(lambda path, headers, body: (200, chat_answer("5"), 0))
    source = _images(1, seed=3)[0]
    Image.fromarray(source).save(tmp_path / "in.png")
    reward = build_reward("vlm_judge", {"base_url": server.url + "/v1", "model": "m", "input_image": True, **FAST})
    edited = _images(1)
    out = reward(edited, ["make the red circle blue"], [{"image": str(tmp_path / "in.png")}])
    assert out.scores.tolist() == [1.0]
    first, second, text = json.loads(server.requests[0]["body"])["messages"][0]["content"]
    prefix = "data:image/png;base64,"
    shown = [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"][len(prefix) :]))))
        for p in (first, second)
    ]
    assert np.array_equal(shown[0], source) and np.array_equal(shown[1], edited[0])
    assert 'instruction "make the red circle blue"' in text["text"]
    with pytest.raises(ValueError, match="no metadata\\['image'\\]"):
        reward(edited, ["x"], [{}])
    with pytest.raises(ValueError, match="needs parser 'rating'"):
        build_reward("vlm_judge", {"base_url": server.url + "/v1", "model": "m", "input_image": True, "parser": "ocr"})
