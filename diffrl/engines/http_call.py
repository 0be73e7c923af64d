"""One HTTP call with a deadline on the whole of it, a cap on the answer's size, and retries of transient failures:
the transport of every network client diffrl has (the network rewards, the vLLM server's probes and requests).

A per-read socket timeout bounds each read, not the call: a server that sends its headers and then one byte a second
never trips it. Here a watchdog shuts the socket down when `timeout_s` has passed since the call began, whatever
phase it is in (connect, sending, headers, body), and the call fails with "no complete answer within T s". An answer
larger than `max_bytes` is refused from its Content-Length or as soon as that many bytes have arrived, never read
whole. A connection refused, reset or closed before the end of the answer is transient: `call_with_retries` tries
again. Errors are one line naming the URL (without its credentials).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from diffrl.engines.redact import redact_text

logger = logging.getLogger(__name__)

MIB = 1 << 20
_CHUNK = 64 * 1024
# What went wrong, by kind: the caller picks which kinds are worth another attempt.
TIMEOUT, TOO_LARGE, BROKEN = "timeout", "too_large", "broken"


class HttpCallError(RuntimeError):
    """A call that got no complete answer. `kind`: TIMEOUT, TOO_LARGE or BROKEN (refused, reset, cut off)."""

    def __init__(self, url: str, what: str, kind: str):
        url = redact_text(url)  # an https://user:TOKEN@host URL is named without its TOKEN
        super().__init__(f"{url}: {what}")
        self.url, self.what, self.kind = url, what, kind


@dataclass(frozen=True)
class Answer:
    """A complete HTTP answer: status code, headers (lower-case names) and the whole body."""

    url: str
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body decoded as JSON (ValueError if it is not)."""
        return json.loads(self.body)


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http:// or https:// URL: {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "http":
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s), path
    import certifi  # requests' CA bundle, so https trusts what it trusted before

    context = ssl.create_default_context(cafile=certifi.where())
    return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s, context=context), path


def _read_body(response: http.client.HTTPResponse, url: str, max_bytes: int) -> bytes:
    """The whole body, at most max_bytes of it; HttpCallError (too_large, broken) otherwise."""
    declared = response.getheader("Content-Length")
    expected = int(declared) if declared and declared.isdigit() else None
    if expected is not None and expected > max_bytes:
        raise HttpCallError(url, f"answer larger than {max_bytes} bytes (Content-Length {expected})", TOO_LARGE)
    chunks, size = [], 0
    try:
        while chunk := response.read1(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise HttpCallError(url, f"answer larger than {max_bytes} bytes", TOO_LARGE)
            chunks.append(chunk)
    except http.client.IncompleteRead:
        raise HttpCallError(url, f"connection closed mid-answer after {size} bytes", BROKEN) from None
    if expected is not None and size < expected:
        raise HttpCallError(url, f"connection closed mid-answer after {size} of {expected} bytes", BROKEN)
    return b"".join(chunks)


def call(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float,
    max_bytes: int,
) -> Answer:
    """One attempt: the complete answer (any status) within timeout_s of the start, else HttpCallError."""
    connection, path = _connection(url, timeout_s)
    expired = threading.Event()

    def expire() -> None:  # wakes a read blocked in any phase: the socket's reads return end-of-stream
        expired.set()
        sock = connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    response: http.client.HTTPResponse | None = None
    watchdog = threading.Timer(timeout_s, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        connection.connect()
        if expired.is_set():  # the watchdog fired while connecting, before there was a socket to shut
            raise TimeoutError
        connection.request(method, path, body=body, headers=dict(headers or {}))
        response = connection.getresponse()
        data = _read_body(response, url, max_bytes)
        if expired.is_set():
            raise TimeoutError
        return Answer(url, response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    except HttpCallError as e:
        if expired.is_set() and e.kind == BROKEN:  # the watchdog's shutdown looks like a cut-off
            raise HttpCallError(url, f"no complete answer within {timeout_s:g} s", TIMEOUT) from None
        raise
    except (OSError, http.client.HTTPException) as e:  # refused, reset, cut off, or the socket's own timeout
        if expired.is_set() or isinstance(e, TimeoutError):
            raise HttpCallError(url, f"no complete answer within {timeout_s:g} s", TIMEOUT) from None
        raise HttpCallError(url, f"{type(e).__name__}: {e}".rstrip(": "), BROKEN) from None
    except (ValueError, AttributeError):  # an SSL socket shut down under a read fails this way
        if expired.is_set():
            raise HttpCallError(url, f"no complete answer within {timeout_s:g} s", TIMEOUT) from None
        raise
    finally:
        watchdog.cancel()
        if response is not None:  # its file holds the socket open: a refused flood must be hung up on
            response.close()
        connection.close()


def call_with_retries(
    method: str,
    url: str,
    *,
    retries: int,
    backoff_s: float,
    retry_kinds: Collection[str] = (TIMEOUT, BROKEN),
    retry_statuses: Collection[int] = (),
    owner: str = "",
    after_failure: Callable[[HttpCallError], None] | None = None,
    **call_kwargs: Any,
) -> Answer:
    """call(), tried again up to `retries` times on the failure kinds in retry_kinds and the statuses in
    retry_statuses, sleeping backoff_s * 2**k before attempt k + 1. `after_failure(error)` runs after each failed
    attempt (it may raise instead, e.g. when a server process has died). After the last attempt HttpCallError
    "<url>: failed after n attempts; last error: ..."; any other failure is raised at once."""
    last_error, last_kind = "", BROKEN
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            answer = call(method, url, **call_kwargs)
        except HttpCallError as e:
            if after_failure is not None:
                after_failure(e)
            if e.kind not in retry_kinds:
                raise
            last_error, last_kind = e.what, e.kind
        else:
            if answer.status not in retry_statuses:
                return answer
            last_error, last_kind = f"HTTP {answer.status}: {answer.text[:200]}", BROKEN
        logger.warning(
            "%s: attempt %d/%d to %s failed: %s",
            owner or "http",
            attempt + 1,
            retries + 1,
            redact_text(url),
            last_error,
        )
    raise HttpCallError(url, f"failed after {retries + 1} attempts; last error: {last_error}", last_kind)
