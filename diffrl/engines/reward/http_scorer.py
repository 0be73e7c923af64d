"""A user's own scorer service over HTTP.

Protocol (one request per image; videos: one per `frame_stride`-th frame, scores averaged):
    POST <url>   multipart/form-data with fields
        image     the image file (image/png or image/jpeg)
        prompt    the prompt text
        metadata  the sample's metadata as a JSON string
    200 -> {"score": <number>}   (the key is the `score_key` option)
A reply without a finite number under `score_key` excludes the sample (valid False, logged,
counted). A request that still fails after `retries` retries raises RewardError.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import numpy as np

from diffrl.engines.reward.base import (
    RewardOutput,
    register_reward,
    sample_frames,
)
from diffrl.engines.reward.http_client import (
    MalformedAnswer,
    api_key_from_env,
    check_request_options,
    encode_image,
    post_with_retries,
    score_each_concurrently,
)

logger = logging.getLogger(__name__)


@dataclass
class HttpScorerOptions:
    """url: the scoring endpoint. api_key_env: environment variable with a bearer token (optional)."""

    url: str
    score_key: str = "score"
    api_key_env: str | None = None
    concurrency: int = 8
    timeout_s: float = 60.0
    max_answer_mib: float = 4.0
    retries: int = 3
    backoff_s: float = 1.0
    image_format: str = "png"
    frame_stride: int = 4
    batch_size: int = 32

    def __post_init__(self):
        check_request_options(self, "http_scorer", url_field="url")


class HttpScorerReward:
    """Holds the request headers for the user's scorer."""

    name = "http_scorer"

    def __init__(self, options: HttpScorerOptions):
        self.options = options
        self.batch_size = options.batch_size
        api_key = api_key_from_env(options.api_key_env, "http_scorer")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}

    def score_frame(self, frame: np.ndarray, prompt: str, meta: dict) -> float:
        """One POST; the finite number under score_key, else MalformedAnswer."""
        o = self.options
        mime = "image/png" if o.image_format == "png" else "image/jpeg"
        body = post_with_retries(
            o.url,
            headers=self.headers,
            reward_name=self.name,
            files={"image": (f"image.{o.image_format}", encode_image(frame, o.image_format), mime)},
            data={"prompt": prompt, "metadata": json.dumps(meta, default=str)},
            timeout_s=o.timeout_s,
            max_answer_mib=o.max_answer_mib,
            retries=o.retries,
            backoff_s=o.backoff_s,
        )
        value = body.get(o.score_key) if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MalformedAnswer(f"no finite number under {o.score_key!r} in {str(body)[:200]!r}")
        return float(value)

    def score_one(self, sample: np.ndarray, prompt: str, meta: dict) -> tuple[float | None, str]:
        """(mean score over frames or None if a reply was malformed, '' or the reason)."""
        try:
            frames = sample_frames(sample, self.options.frame_stride)
            return float(np.mean([self.score_frame(f, prompt, meta) for f in frames])), ""
        except MalformedAnswer as e:
            logger.warning("http_scorer: excluding a sample: %s", e)
            return None, f"malformed: {e}"

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        return score_each_concurrently(
            "http_scorer", images, prompts, metadata, self.score_one, self.options.concurrency, info_key="error"
        )


@register_reward("http_scorer", options=HttpScorerOptions)
def http_scorer(options: HttpScorerOptions) -> HttpScorerReward:
    """POST image bytes + prompt to a user's scorer service; JSON score back."""
    return HttpScorerReward(options)
