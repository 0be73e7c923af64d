"""RetryWhenBusy (diffrl/flows/prefect_server.py): the temporary Prefect server runs again a request its database
answered 503, instead of the client waiting 2 s to resend it.

The app behind the middleware here is a small ASGI function standing in for Prefect's server with a locked SQLite
database (answers 503 a given number of times): a real lock race is not reproducible on demand."""

from __future__ import annotations

import asyncio
import json

import pytest

from diffrl.flows.prefect_server import RetryWhenBusy, server_environment


def _busy_app(busy_times: int, calls: list[bytes]):
    async def app(scope, receive, send):
        message = await receive()
        calls.append(message["body"])
        if len(calls) <= busy_times:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b'{"exception_message": "Service Unavailable"}'})
            # Starlette's ServerErrorMiddleware raises the handled error again after answering
            raise RuntimeError("database is locked")
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        for part in (b'{"echo": ', message["body"], b"}"):  # a streamed answer: three body messages
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _request(app, body: bytes, sent: list[dict] | None = None) -> list[dict]:
    sent = [] if sent is None else sent
    parts = [body[:5], body[5:]]  # the body in two messages, as a client may send it

    async def receive():
        if parts:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await asyncio.sleep(10)  # nothing more from this client
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/task_runs/"}
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_request_answered_busy_runs_again_with_its_body_and_only_the_answer_reaches_the_client():
    calls: list[bytes] = []
    body = json.dumps({"name": "rl_step", "dynamic_key": "3"}).encode()
    sent = _request(RetryWhenBusy(_busy_app(3, calls), waits=(0.001,) * 5), body)
    assert calls == [body] * 4  # three 503s, then the answer, each try with the whole body
    assert sent[0]["status"] == 201 and [m["type"] for m in sent].count("http.response.start") == 1
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:])) == {
        "echo": {"name": "rl_step", "dynamic_key": "3"}
    }


def test_a_request_still_busy_after_every_wait_gets_the_503_for_the_client_to_retry():
    calls: list[bytes] = []
    sent: list[dict] = []
    with pytest.raises(RuntimeError, match="database is locked"):  # on to uvicorn, which logs it, as without us
        _request(RetryWhenBusy(_busy_app(100, calls), waits=(0.001, 0.001)), b"{}", sent)
    assert len(calls) == 3  # the first try and one after each wait
    assert sent[0]["status"] == 503 and len(sent) == 2


def test_the_temporary_server_sends_no_telemetry_unless_the_user_turns_it_on(monkeypatch):
    """Prefect's server reports usage every few minutes and logs "Failed to send telemetry" offline: diffrl's
    temporary server has it off, whichever process starts the server; a user's exported setting wins."""
    monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
    assert server_environment()["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")
    assert server_environment()["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"
