"""Every network client's transport (diffrl/engines/http_call.py) against a fake server on loopback that trickles,
floods and cuts off (tests/engines/misbehaving_server.py: no real judge or vLLM server can misbehave on cue): a deadline
on the whole call, a cap on the answer's size, retries of a cut-off answer; through the rewards and the vLLM server.

Time bounds are generous (the deadline + 5 s) so a loaded 2-core machine does not fail them."""

from __future__ import annotations

import os
import stat
import sys
import time

import numpy as np
import pytest
from misbehaving_server import ANSWER, FLOOD_BYTES, MisbehavingServer

from diffrl.configs.vllm import VllmServerOptions
from diffrl.engines.http_call import BROKEN, TIMEOUT, TOO_LARGE, HttpCallError, call, call_with_retries
from diffrl.engines.reward.base import RewardError, build_reward
from diffrl.engines.vllm_server import VllmServer, VllmServerError


@pytest.fixture
def server():
    running = MisbehavingServer().start()
    yield running
    running.close()


@pytest.mark.parametrize("path", ["/trickle", "/slow-headers"])
def test_a_trickling_answer_fails_at_the_deadline(server, path):
    started = time.monotonic()
    with pytest.raises(HttpCallError, match=rf"^{server.url}{path}: no complete answer within 2 s$") as error:
        call("POST", server.url + path, body=b"{}", timeout_s=2, max_bytes=1 << 20)
    assert error.value.kind == TIMEOUT
    assert 1.5 < time.monotonic() - started < 2 + 5  # per read it never waits 2 s: only the whole call does


@pytest.mark.parametrize("path", ["/flood", "/flood-declared"])
def test_a_flood_is_refused_without_reading_it(server, path):
    with pytest.raises(HttpCallError, match=rf"^{server.url}{path}: answer larger than 65536 bytes") as error:
        call("POST", server.url + path, body=b"{}", timeout_s=30, max_bytes=64 << 10)
    assert error.value.kind == TOO_LARGE
    deadline = time.monotonic() + 10
    while not server.flood_sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.flood_sent and server.flood_sent[0] < FLOOD_BYTES // 2  # it stopped once the client hung up


@pytest.mark.parametrize("path", ["/cut-then-ok", "/cut-then-ok-chunked"])
def test_an_answer_cut_off_mid_body_is_retried(server, path):
    answer = call_with_retries(
        "POST", server.url + path, body=b"{}", timeout_s=10, max_bytes=1 << 20, retries=1, backoff_s=0.01
    )
    assert (answer.status, answer.body, server.requests[path[1:]]) == (200, ANSWER, 2)  # cut, then answered
    with pytest.raises(HttpCallError, match=rf"^{server.url}{path}: connection closed mid-answer") as error:
        call("POST", server.url + path, body=b"{}", timeout_s=10, max_bytes=1 << 20)  # one attempt: the cut
    assert error.value.kind == BROKEN


def test_retries_stop_at_the_last_attempt_with_the_last_error(server):
    started = time.monotonic()
    with pytest.raises(HttpCallError, match=r"failed after 2 attempts; last error: no complete answer within 1 s$"):
        call_with_retries(
            "POST", server.url + "/trickle", body=b"{}", timeout_s=1, max_bytes=1 << 20, retries=1, backoff_s=0.01
        )
    assert time.monotonic() - started < 2 + 5 and server.requests["trickle"] == 2
    with pytest.raises(HttpCallError, match="answer larger than"):  # too large is not retried
        call_with_retries("POST", server.url + "/flood", timeout_s=10, max_bytes=1024, retries=3, backoff_s=0.01)
    assert server.requests["flood"] == 1


def _images(n: int) -> np.ndarray:
    return np.zeros((n, 8, 8, 3), dtype=np.uint8)


@pytest.mark.parametrize("kind", ["vlm_judge", "http_scorer"])
def test_rewards_bound_a_trickling_judge_and_retry_a_cut_off_one(server, kind):
    url_key = "base_url" if kind == "vlm_judge" else "url"
    extra = {"model": "m"} if kind == "vlm_judge" else {}
    options = {"timeout_s": 1, "retries": 1, "backoff_s": 0.01, **extra}
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"failed after 2 attempts; last error: no complete answer within 1 s"):
        build_reward(kind, {url_key: server.url + "/trickle", **options})(_images(1), ["x"], [{}])
    assert time.monotonic() - started < 2 * 1 + 5
    with pytest.raises(RewardError, match=r"answer larger than 1048576 bytes"):
        build_reward(kind, {url_key: server.url + "/flood", **options, "max_answer_mib": 1})(_images(1), ["x"], [{}])
    out = build_reward(kind, {url_key: server.url + "/cut-then-ok", **options})(_images(1), ["x"], [{}])
    assert out.valid.tolist() == [True] and out.scores.tolist() == [1.0 if kind == "vlm_judge" else 0.5]


def test_vllm_server_probes_and_requests_are_bounded(tmp_path):
    """VllmServer starts the fake server as it starts vLLM (an interpreter given the launcher and vLLM's flags)."""
    python = tmp_path / "python"
    script = os.path.join(os.path.dirname(__file__), "misbehaving_server.py")
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    options = VllmServerOptions(start_timeout_s=60, request_timeout_s=2, max_answer_mib=1)
    with VllmServer(str(tmp_path), options, python=str(python), log_path=str(tmp_path / "log")) as vllm:
        started = time.monotonic()
        with pytest.raises(VllmServerError, match=r"/v1/completions: no complete answer within 2 s$"):
            vllm.request("POST", "/trickle/v1/completions", json={})
        assert time.monotonic() - started < 2 + 5
        with pytest.raises(VllmServerError, match=r"answer larger than 1048576 bytes"):
            vllm.request("POST", "/flood/v1/completions", json={})
        assert vllm.request("POST", "/cut-then-ok/v1/completions", json={}).json()["score"] == 0.5
        assert vllm.healthy(timeout_s=5)


def test_vllm_health_probe_that_trickles_is_not_healthy(tmp_path):
    slow = MisbehavingServer(health="slow-headers").start()
    try:
        probe = VllmServer(str(tmp_path), VllmServerOptions(port=slow.server.server_address[1]), python=sys.executable)
        started = time.monotonic()
        assert not probe.healthy(timeout_s=1)
        assert time.monotonic() - started < 1 + 5 and slow.requests["slow-headers"] == 1
    finally:
        slow.close()


def test_a_urls_credentials_stay_out_of_errors_and_logs(server, caplog):
    url = server.url.replace("http://", "http://user:TOKEN@") + "/trickle"
    with pytest.raises(RewardError) as error:
        build_reward("http_scorer", {"url": url, "timeout_s": 1, "retries": 1, "backoff_s": 0.01})(
            _images(1), ["x"], [{}]
        )
    assert "http://***@127.0.0.1:" in str(error.value) and "TOKEN" not in str(error.value)
    assert caplog.records and not any("TOKEN" in record.getMessage() for record in caplog.records)
