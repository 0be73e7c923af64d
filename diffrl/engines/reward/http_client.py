"""HTTP plumbing shared by the network rewards (vlm_judge, http_scorer): retries with exponential
backoff, a deadline on every call as a whole and a cap on the answer's size (diffrl/engines/http_call.py), a
concurrency limit, API keys from environment variables."""

from __future__ import annotations

import base64
import io
import logging
import os
import wave
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import numpy as np
import requests
from PIL import Image

from diffrl.engines.http_call import MIB, HttpCallError, call_with_retries
from diffrl.engines.redact import redact_text
from diffrl.engines.reward.base import RewardError, RewardOutput, check_choice, check_positive, to_uint8_numpy

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Transient statuses worth another attempt; any other 4xx is the caller's bug and fails at once.
RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class MalformedAnswer(ValueError):
    """The server answered, but not in the expected shape: the sample is excluded, not retried."""


def api_key_from_env(variable: str | None, owner: str) -> str | None:
    """The API key in environment variable `variable` (None when no variable is configured).

    A configured but unset variable fails at start-up: a run must not discover it mid-way.
    """
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(f"{owner}: option 'api_key_env' names {variable!r}, but that environment variable is not set")
    return key


def encode_image(image_HW3: np.ndarray, image_format: str = "png") -> bytes:
    """RGB uint8 image -> PNG or JPEG (quality 95) bytes."""
    buffer = io.BytesIO()
    if image_format == "png":
        Image.fromarray(image_HW3).save(buffer, format="PNG")
    else:
        Image.fromarray(image_HW3).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def encode_wav(waveform_CT: np.ndarray, sample_rate: int) -> bytes:
    """Float waveform (C, T) in [-1, 1] -> a 16-bit PCM WAV file (C channels) as diffrl/models/wav.py reads it.

    Samples beyond [-1, 1] are clipped to full scale (16-bit PCM has no headroom); x maps to round(x * 32767)."""
    pcm_TC = np.round(np.clip(waveform_CT, -1.0, 1.0) * 32767.0).astype("<i2").T
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(waveform_CT.shape[0])
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(np.ascontiguousarray(pcm_TC).tobytes())
    return buffer.getvalue()


def data_url(image_HW3: np.ndarray, image_format: str = "png") -> str:
    """A base64 data URL as OpenAI-compatible chat servers accept in `image_url.url`."""
    mime = "image/png" if image_format == "png" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(encode_image(image_HW3, image_format)).decode('ascii')}"


def post_with_retries(
    url: str,
    *,
    reward_name: str,
    headers: dict[str, str],
    timeout_s: float,
    max_answer_mib: float,
    retries: int,
    backoff_s: float,
    **request_kwargs: Any,
) -> Any:
    """POSTs (request_kwargs as requests takes them: json=, or files= and data=) and returns the decoded JSON body.

    Each attempt must bring the complete answer within timeout_s and at most max_answer_mib
    (diffrl/engines/http_call.py). Connection errors, cut-off answers, timeouts and RETRY_STATUSES are
    retried `retries` times, sleeping backoff_s * 2**attempt between attempts; after the last attempt
    (or an answer too large) a RewardError names the URL and the failure. A body that is not JSON raises
    MalformedAnswer (not retried).
    """
    request = requests.Request("POST", url, headers=headers, **request_kwargs).prepare()  # encodes the body only
    body = request.body.encode() if isinstance(request.body, str) else request.body
    try:
        answer = call_with_retries(
            "POST",
            url,
            body=body,
            headers=request.headers,
            timeout_s=timeout_s,
            max_bytes=int(max_answer_mib * MIB),
            retries=retries,
            backoff_s=backoff_s,
            retry_statuses=RETRY_STATUSES,
            owner=reward_name,
        )
    except HttpCallError as e:
        raise RewardError(f"{reward_name}: {e}", reward_name) from None
    if answer.status >= 400:
        raise RewardError(
            f"{reward_name}: {redact_text(url)} answered HTTP {answer.status}: {answer.text[:500]}", reward_name
        )
    try:
        return answer.json()
    except ValueError:
        raise MalformedAnswer(f"{redact_text(url)} answered a non-JSON body: {answer.text[:200]!r}") from None


def map_concurrently(function: Callable[[int], T], count: int, concurrency: int) -> list[T]:
    """[function(i) for i in range(count)] with at most `concurrency` running at once, in order.

    The first exception propagates; requests not yet started are cancelled.
    """
    if count == 0:
        return []
    with ThreadPoolExecutor(max_workers=min(concurrency, count)) as executor:
        futures = [executor.submit(function, i) for i in range(count)]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def score_each_concurrently(
    name: str,
    images,
    prompts: list[str],
    metadata: list[dict],
    score_one: Callable[[Any, str, dict], tuple[float | None, Any]],
    concurrency: int,
    info_key: str,
    split: Callable[[Any], Any] = to_uint8_numpy,
) -> RewardOutput:
    """A reward's output from one request per sample (`score_one(sample, prompt, metadata)` ->
    (score or None for an excluded sample, info)), at most `concurrency` requests at once; `split(images)` gives
    the samples (by default the uint8 images or videos)."""
    array = split(images)
    if not len(array) == len(prompts) == len(metadata):
        raise ValueError(f"{name}: got {len(array)} images, {len(prompts)} prompts, {len(metadata)} metadata")
    results = map_concurrently(lambda i: score_one(array[i], prompts[i], metadata[i]), len(array), concurrency)
    return RewardOutput.from_lists([score for score, _ in results], info={info_key: [x for _, x in results]})


def check_request_options(options, owner: str, url_field: str) -> None:
    """The request options every HTTP reward shares: the URL's scheme, image format, concurrency,
    timeout, answer size, frame stride, batch size (> 0), retries and backoff (>= 0), those of them `options` has.
    ValueError naming the option."""
    url = getattr(options, url_field)
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{owner}: option '{url_field}' must start with http:// or https://, got {url!r}")
    if hasattr(options, "image_format"):  # the audio scorer has no images
        check_choice(options.image_format, "image_format", owner, ("png", "jpeg"))
    for name in ("concurrency", "timeout_s", "max_answer_mib", "frame_stride", "batch_size"):
        if hasattr(options, name):
            check_positive(getattr(options, name), name, owner)
    check_positive(options.retries, "retries", owner, allow_zero=True)
    check_positive(options.backoff_s, "backoff_s", owner, allow_zero=True)
