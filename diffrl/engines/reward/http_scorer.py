"""A user's own scorer service over HTTP, for images and videos (`http_scorer`) or audio (`http_audio_scorer`).

Protocol (one request per image; videos: one per `frame_stride`-th frame, scores averaged; audio: one per clip):
    POST <url>   multipart/form-data with fields
        image     the image file (image/png or image/jpeg)          http_scorer
        audio     the clip as a 16-bit PCM WAV file (audio/wav),     http_audio_scorer
                  its channels and sample rate as generated (samples clipped to [-1, 1])
        prompt    the prompt text
        metadata  the sample's metadata as a JSON string
    200 -> {"score": <number>}   (the key is the `score_key` option)
A reply without a finite number under `score_key` excludes the sample (valid False, logged,
counted), as does a clip that cannot be sent (no samples, a non-finite sample). A request that still fails after
`retries` retries raises RewardError.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from diffrl.engines.reward.audio import audio_problem
from diffrl.engines.reward.base import (
    RewardOutput,
    register_reward,
    sample_frames,
    to_audio,
)
from diffrl.engines.reward.http_client import (
    MalformedAnswer,
    api_key_from_env,
    check_request_options,
    encode_image,
    encode_wav,
    post_with_retries,
    score_each_concurrently,
)

logger = logging.getLogger(__name__)


@dataclass
class HttpAudioScorerOptions:
    """url: the scoring endpoint. api_key_env: environment variable with a bearer token (optional)."""

    OWNER: ClassVar[str] = "http_audio_scorer"

    url: str
    score_key: str = "score"
    api_key_env: str | None = None
    concurrency: int = 8
    timeout_s: float = 60.0
    max_answer_mib: float = 4.0
    retries: int = 3
    backoff_s: float = 1.0
    batch_size: int = 32

    def __post_init__(self):
        check_request_options(self, self.OWNER, url_field="url")


@dataclass
class HttpScorerOptions(HttpAudioScorerOptions):
    """The audio scorer's options, and image_format (png, jpeg) and frame_stride (videos: every n-th frame)."""

    OWNER: ClassVar[str] = "http_scorer"

    image_format: str = "png"
    frame_stride: int = 4


class HttpScorerReward:
    """Holds the request headers for the user's scorer; `audio` sends each sample's clip instead of its image(s)."""

    def __init__(self, options: HttpAudioScorerOptions, audio: bool):
        self.options = options
        self.audio = audio
        self.name = options.OWNER
        self.batch_size = options.batch_size
        api_key = api_key_from_env(options.api_key_env, self.name)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}

    def post_file(self, field: tuple[str, tuple[str, bytes, str]], prompt: str, meta: dict) -> float:
        """One POST of a file field (name, (filename, bytes, mime)); the finite number under score_key, else
        MalformedAnswer."""
        o = self.options
        body = post_with_retries(
            o.url,
            headers=self.headers,
            reward_name=self.name,
            files=dict([field]),
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

    def score_sample(self, sample, prompt: str, meta: dict) -> float:
        """The mean score over an image's or video's frames, or the score of one (waveform_CT, sample_rate) clip."""
        if self.audio:
            waveform, rate = sample
            return self.post_file(("audio", ("audio.wav", encode_wav(waveform, rate), "audio/wav")), prompt, meta)
        o = self.options
        fmt = o.image_format
        mime = "image/png" if fmt == "png" else "image/jpeg"
        frames = sample_frames(sample, o.frame_stride)
        fields = [("image", (f"image.{fmt}", encode_image(frame, fmt), mime)) for frame in frames]
        return float(np.mean([self.post_file(field, prompt, meta) for field in fields]))

    def score_one(self, sample, prompt: str, meta: dict) -> tuple[float | None, str]:
        """(score, or None if a reply was malformed or the clip could not be sent; '' or the reason)."""
        problem = audio_problem(sample[0]) if self.audio else ""
        if problem:
            logger.warning("%s: excluding a sample: %s", self.name, problem)
            return None, f"not sent: {problem}"
        try:
            return self.score_sample(sample, prompt, meta), ""
        except MalformedAnswer as e:
            logger.warning("%s: excluding a sample: %s", self.name, e)
            return None, f"malformed: {e}"

    def clips(self, samples) -> list[tuple[np.ndarray, int]]:
        """An AudioBatch as (waveform_CT, sample_rate) per sample."""
        batch = to_audio(samples, self.name)
        return [(waveform, batch.sample_rate) for waveform in batch.waveform]

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        kwargs = {"split": self.clips} if self.audio else {}
        return score_each_concurrently(
            self.name, images, prompts, metadata, self.score_one, self.options.concurrency, info_key="error", **kwargs
        )


@register_reward("http_scorer", options=HttpScorerOptions)
def http_scorer(options: HttpScorerOptions) -> HttpScorerReward:
    """POST image bytes + prompt to a user's scorer service; JSON score back."""
    return HttpScorerReward(options, audio=False)


@register_reward("http_audio_scorer", options=HttpAudioScorerOptions)
def http_audio_scorer(options: HttpAudioScorerOptions) -> HttpScorerReward:
    """POST a WAV clip + prompt to a user's scorer service (a learned audio model); JSON score back."""
    return HttpScorerReward(options, audio=True)
