"""VLM-as-judge reward: a client of any OpenAI-compatible chat-completions server (vLLM `serve`,
SGLang, `transformers serve`, a hosted API).

Each sample is one request: the image (videos: every `frame_stride`-th frame) as base64 data URLs
in `image_url` parts, then the text prompt. The answer (choices[0].message.content) is parsed by:
- "ocr": the answer is a transcription, scored against the target text exactly like the `ocr`
  reward (ground truth, else the first "quoted" text of the prompt).
- "rating": the first number 1-5 in the answer, normalised to [0, 1] as (r - 1) / 4.
With `input_image: true` (image editing) the request shows the sample's input image (metadata["image"], a path)
first and the edited image second, and the default rating question asks how well the edit follows the instruction
and keeps the rest of the input.
A malformed answer (no content, no rating) excludes that sample (valid False, counted, logged).
A request that still fails after `retries` retries raises RewardError: never a silent 0.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

from diffrl.engines.reward.base import (
    RewardOutput,
    check_choice,
    check_positive,
    register_reward,
    sample_frames,
)
from diffrl.engines.reward.http_client import (
    MalformedAnswer,
    api_key_from_env,
    check_request_options,
    data_url,
    post_with_retries,
    score_each_concurrently,
)
from diffrl.engines.reward.text import target_text, text_similarity

logger = logging.getLogger(__name__)

PARSERS = ("ocr", "rating")
DEFAULT_PROMPTS = {
    "ocr": "Transcribe all the text visible in this image exactly. Answer with the text only.",
    "rating": (
        'How well does this image match the description "{prompt}"? Rate it from 1 (not at all) to '
        "5 (perfectly), considering content, text and quality. Answer with the number only."
    ),
}
EDIT_RATING_PROMPT = (
    'The first image is the input; the second is meant to be the input edited by the instruction "{prompt}". '
    "Rate from 1 (not at all) to 5 (perfectly) how well the second image carries out the instruction while keeping "
    "everything else of the input unchanged. Answer with the number only."
)
# The first number of the answer ("4", "4.5", "Rating: 4/5."); it must lie in [1, 5].
_RATING = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)(?!\.?\d)")


@dataclass
class VlmJudgeOptions:
    """base_url: the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1. prompt_template:
    the question; "{prompt}" is replaced by the sample's prompt. api_key_env: the name of the
    environment variable holding the API key (never the key itself). input_image: show the sample's input image
    (metadata["image"]) before the generated one, for editing models (default question: EDIT_RATING_PROMPT)."""

    base_url: str
    model: str
    parser: str = "rating"
    prompt_template: str | None = None
    api_key_env: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    concurrency: int = 8
    timeout_s: float = 60.0
    max_answer_mib: float = 4.0
    retries: int = 3
    backoff_s: float = 1.0
    image_format: str = "png"
    frame_stride: int = 4
    batch_size: int = 32
    input_image: bool = False

    def __post_init__(self):
        check_choice(self.parser, "parser", "vlm_judge", PARSERS)
        if self.input_image and self.parser != "rating":
            raise ValueError(
                "vlm_judge: option 'input_image' needs parser 'rating' (an OCR transcription has no input)"
            )
        check_request_options(self, "vlm_judge", url_field="base_url")
        check_positive(self.max_tokens, "max_tokens", "vlm_judge")


def parse_rating(answer: str) -> float:
    """'4' -> 0.75: the answer's first number (must lie in [1, 5]) mapped to [0, 1]; else MalformedAnswer."""
    match = _RATING.search(answer)
    if match is None or not 1.0 <= float(match.group(1)) <= 5.0:
        raise MalformedAnswer(f"no rating 1-5 in the answer {answer[:200]!r}")
    return (float(match.group(1)) - 1.0) / 4.0


def message_content(body: dict) -> str:
    """choices[0].message.content as text (a string, or a list of text parts). MalformedAnswer otherwise."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise MalformedAnswer(f"no choices[0].message.content in {str(body)[:200]!r}") from None
    if isinstance(content, list):  # some servers return content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip():
        raise MalformedAnswer(f"empty or non-text content {content!r}")
    return content


def input_image(meta: dict) -> np.ndarray:
    """The sample's input image (metadata["image"], a path) as uint8 (H, W, 3); ValueError naming it otherwise."""
    path = meta.get("image")
    if not isinstance(path, str) or not path:
        raise ValueError(f"vlm_judge (input_image): the sample has no metadata['image'] path; got {path!r}")
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except OSError as e:
        raise ValueError(f"vlm_judge (input_image): cannot read the input image {path!r} ({e})") from None


class VlmJudgeReward:
    """Holds the request headers for the judge server."""

    name = "vlm_judge"

    def __init__(self, options: VlmJudgeOptions):
        self.options = options
        self.batch_size = options.batch_size
        self.url = options.base_url.rstrip("/") + "/chat/completions"
        default = EDIT_RATING_PROMPT if options.input_image else DEFAULT_PROMPTS[options.parser]
        self.template = options.prompt_template or default
        api_key = api_key_from_env(options.api_key_env, "vlm_judge")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}

    def request_body(self, sample, prompt: str, meta: dict | None = None) -> dict:
        """The chat-completions request for one image (or the sampled frames of one video); with `input_image`,
        the input image (metadata["image"]) first."""
        frames = sample_frames(sample, self.options.frame_stride)
        if self.options.input_image:
            frames = [input_image(meta or {}), *frames]
        content = [{"type": "image_url", "image_url": {"url": data_url(f, self.options.image_format)}} for f in frames]
        content.append({"type": "text", "text": self.template.replace("{prompt}", prompt)})
        return {
            "model": self.options.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.options.max_tokens,
            "temperature": self.options.temperature,
        }

    def judge_one(self, sample, prompt: str, meta: dict) -> tuple[float | None, str]:
        """(score or None if the answer is malformed, the raw answer or the reason)."""
        o = self.options
        target = target_text(prompt, meta) if o.parser == "ocr" else None
        if o.parser == "ocr" and target is None:
            raise ValueError(f'vlm_judge (ocr parser): no ground_truth and no "quoted text" in the prompt {prompt!r}')
        try:
            body = post_with_retries(
                self.url,
                headers=self.headers,
                reward_name=self.name,
                json=self.request_body(sample, prompt, meta),
                timeout_s=o.timeout_s,
                max_answer_mib=o.max_answer_mib,
                retries=o.retries,
                backoff_s=o.backoff_s,
            )
            answer = message_content(body)
            score = text_similarity(target, answer) if o.parser == "ocr" else parse_rating(answer)
        except MalformedAnswer as e:
            logger.warning("vlm_judge: excluding a sample: %s", e)
            return None, f"malformed: {e}"
        return score, answer

    def __call__(self, images, prompts: list[str], metadata: list[dict]) -> RewardOutput:
        return score_each_concurrently(
            "vlm_judge", images, prompts, metadata, self.judge_one, self.options.concurrency, info_key="answer"
        )


@register_reward("vlm_judge", options=VlmJudgeOptions)
def vlm_judge(options: VlmJudgeOptions) -> VlmJudgeReward:
    """An OpenAI-compatible chat-completions judge (OCR transcription or 1-5 rating)."""
    return VlmJudgeReward(options)
