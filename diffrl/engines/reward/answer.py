"""Rule-based rewards for the text answers of autoregressive models (token rollouts: engines/rollout/tokens.py).

Each takes the decoded responses as a list of B str where image rewards take images, and the prompt's ground truth
from metadata[i]["ground_truth"]; none evaluates answer text (parsing only).

- exact_match:   1.0 when the extracted, normalised answer equals the ground truth (a string or a list of accepted
                 strings), else 0.0.
- numeric_match: 1.0 when the last number of the extracted answer is within `rel_tol` / `abs_tol` of the numeric
                 ground truth (math.isclose), else 0.0; 0.0 when the answer holds no number.
- format_check:  1.0 when the response matches the configured regex (re.search), else 0.0 (default: a
                 DeepSeek-R1 style "<think>...</think> <answer>...</answer>" response).
- length_target: max(0, 1 - |n - target| / target) for a response of n characters: a rule that varies on any text,
                 a random model's included (what a speed measurement trains on when no answer can be right).

Extraction (`extract`): "boxed" = the content of the last \\boxed{...} (nested braces matched), "answer_tag" = the
content of the last <answer>...</answer>, "marker" = the text after the last `marker` (case-insensitive, "Answer:" by
default), "none" = the whole response, "auto" (default) = the first of boxed, answer_tag, marker that is present,
else the whole response. A response without the requested form scores 0.0 (a wrong answer, not an excluded sample:
info["extracted"] is None). A missing or malformed ground truth is a ValueError naming the sample.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diffrl.engines.reward.base import RewardOutput, check_choice, check_positive, register_reward, to_texts

EXTRACT_CHOICES = ("auto", "boxed", "answer_tag", "marker", "none")
# Characters stripped from both ends by the normalisation: whitespace, sentence punctuation, quotes, brackets and
# markdown emphasis. Not "-", "+", "$", "%", "#": they change what an answer means ("-5" is not "5").
SURROUNDING = " \t\n\r.,;:!?'\"`*()[]{}“”‘’"
DEFAULT_FORMAT = r"(?s)^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"

_ANSWER_TAG = re.compile(r"(?s)<answer>(.*?)</answer>")
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-+−])?(?:"
    r"\\d?frac\{(?P<tex_num>\d+)\}\{(?P<tex_den>\d+)\}"  # \frac{3}{4}, \dfrac{3}{4}
    r"|(?P<num>\d+)/(?P<den>\d+)"  # 3/4
    r"|(?P<int>\d{1,3}(?:,\d{3})+|\d+)?(?:\.(?P<decimals>\d+))?(?:[eE](?P<exp>[-+]?\d+))?"  # 1,234.5 / .5 / 1e3
    r")(?![\d/])"
)


@dataclass
class ExactMatchOptions:
    """extract: where the answer is (module docstring). marker: the final-answer marker of extract "marker"/"auto".
    normalize: strip, casefold, collapse whitespace, strip surrounding punctuation (False: compare verbatim)."""

    extract: str = "auto"
    marker: str = "Answer:"
    normalize: bool = True
    batch_size: int = 256

    def __post_init__(self):
        check_choice(self.extract, "extract", "exact_match", EXTRACT_CHOICES)
        if not self.marker.strip():
            raise ValueError("exact_match: option 'marker' must be a non-empty string, e.g. 'Answer:'")
        check_positive(self.batch_size, "batch_size", "exact_match")


@dataclass
class NumericMatchOptions:
    """extract/marker: as exact_match. rel_tol, abs_tol: math.isclose tolerances against the ground truth."""

    extract: str = "auto"
    marker: str = "Answer:"
    rel_tol: float = 1e-6
    abs_tol: float = 0.0
    batch_size: int = 256

    def __post_init__(self):
        check_choice(self.extract, "extract", "numeric_match", EXTRACT_CHOICES)
        if not self.marker.strip():
            raise ValueError("numeric_match: option 'marker' must be a non-empty string, e.g. 'Answer:'")
        check_positive(self.rel_tol, "rel_tol", "numeric_match", allow_zero=True)
        check_positive(self.abs_tol, "abs_tol", "numeric_match", allow_zero=True)
        check_positive(self.batch_size, "batch_size", "numeric_match")


@dataclass
class FormatCheckOptions:
    """pattern: a Python regex searched in the response (re.search; anchor it with ^...$ and add (?s) for "."
    across lines, as the default does)."""

    pattern: str = DEFAULT_FORMAT
    batch_size: int = 256

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"format_check: option 'pattern' is not a valid regex ({e}): {self.pattern!r}") from None
        check_positive(self.batch_size, "batch_size", "format_check")


@dataclass
class LengthTargetOptions:
    """target_chars: the response length (in characters) that scores 1.0; the score falls linearly to 0 at 0 and at
    twice the target."""

    target_chars: int = 200
    batch_size: int = 256

    def __post_init__(self):
        check_positive(self.target_chars, "target_chars", "length_target")
        check_positive(self.batch_size, "batch_size", "length_target")


def normalize_answer(text: str) -> str:
    """Casefolded, whitespace runs collapsed to one space, SURROUNDING characters stripped from both ends."""
    return " ".join(text.casefold().split()).strip(SURROUNDING)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces inside it balanced), None if there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth < 0:
            return text[begin:index]
    return None


def extract_answer(text: str, extract: str, marker: str = "Answer:") -> str | None:
    """The answer part of a response per `extract` (module docstring); None when that part is absent."""
    boxed = last_boxed(text) if extract in ("auto", "boxed") else None
    if boxed is not None or extract == "boxed":
        return boxed
    tags = _ANSWER_TAG.findall(text) if extract in ("auto", "answer_tag") else []
    if tags or extract == "answer_tag":
        return tags[-1] if tags else None
    # a regex, not casefold().rfind: casefolding can change lengths ("ß" -> "ss") and so the index
    markers = list(re.finditer(re.escape(marker), text, re.IGNORECASE)) if extract in ("auto", "marker") else []
    if markers or extract == "marker":
        return text[markers[-1].end() :] if markers else None
    return text


def _number_value(match: re.Match) -> float | None:
    """The value of one _NUMBER match; None for a match without digits or a zero denominator. Plain floats, not
    Fractions: float() of a decimal string has no digit limit (a 5,000-digit answer is inf, not a ValueError)."""
    sign = -1.0 if match["sign"] in ("-", "−") else 1.0
    num, den = match["tex_num"] or match["num"], match["tex_den"] or match["den"]
    if num is not None:
        return sign * float(num) / float(den) if float(den) else None
    if match["int"] is None and match["decimals"] is None:
        return None  # a bare sign or exponent: no digits
    digits = f"{(match['int'] or '0').replace(',', '')}.{match['decimals'] or '0'}e{match['exp'] or '0'}"
    return sign * float(digits)


def parse_numbers(text: str) -> list[float]:
    """Every number in `text`, in order: ints, decimals (".5"), signs ("-", "+", "−"), thousands separators
    ("1,234"), exponents ("1e-3"), fractions "3/4" and \\frac{3}{4}. A fraction over 0 is not a number."""
    values = (_number_value(m) for m in _NUMBER.finditer(text))
    return [v for v in values if v is not None]


def parse_last_number(text: str) -> float | None:
    """The last number of `text` (parse_numbers), None when there is none."""
    numbers = parse_numbers(text)
    return numbers[-1] if numbers else None


def ground_truths(metadata: dict, index: int, owner: str) -> list:
    """metadata["ground_truth"] as a non-empty list (a single value becomes [value]); ValueError naming the sample."""
    if not isinstance(metadata, dict) or metadata.get("ground_truth") is None:
        raise ValueError(f"{owner}: sample {index} has no metadata['ground_truth'] to compare its answer with")
    truth = metadata["ground_truth"]
    accepted = list(truth) if isinstance(truth, (list, tuple)) else [truth]
    if not accepted:
        raise ValueError(f"{owner}: sample {index} has an empty list as metadata['ground_truth']")
    for value in accepted:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(
                f"{owner}: sample {index} has a ground truth of type {type(value).__name__} ({value!r}); "
                "expected a str or number, or a list of them"
            )
    return accepted


def numeric_truths(metadata: dict, index: int) -> list[float]:
    """The accepted numbers of a sample: numbers as they are, strings holding exactly one number (e.g. "1,234",
    "3/4"); ValueError naming the sample otherwise."""
    values = []
    for truth in ground_truths(metadata, index, "numeric_match"):
        numbers = [float(truth)] if not isinstance(truth, str) else parse_numbers(truth)
        if len(numbers) != 1 or not math.isfinite(numbers[0]):
            raise ValueError(
                f"numeric_match: sample {index} has ground truth {truth!r}, which is not exactly one finite number"
            )
        values.append(numbers[0])
    return values


def score_exact_match(options: ExactMatchOptions, response: str, metadata: dict, index: int) -> tuple[float, Any]:
    """(1.0 if the extracted answer equals an accepted ground truth else 0.0, the compared answer or None)."""
    prepare = normalize_answer if options.normalize else str
    accepted = {prepare(str(truth)) for truth in ground_truths(metadata, index, "exact_match")}
    answer = extract_answer(response, options.extract, options.marker)
    if answer is None:
        return 0.0, None
    answer = prepare(answer)
    return float(answer in accepted), answer


def score_numeric_match(options: NumericMatchOptions, response: str, metadata: dict, index: int) -> tuple[float, Any]:
    """(1.0 if the answer's last number is close to an accepted number else 0.0, that number or None)."""
    accepted = numeric_truths(metadata, index)
    answer = extract_answer(response, options.extract, options.marker)
    value = parse_last_number(answer) if answer is not None else None
    if value is None:
        return 0.0, None
    close = any(math.isclose(value, truth, rel_tol=options.rel_tol, abs_tol=options.abs_tol) for truth in accepted)
    return float(close), value


def score_format_check(options: FormatCheckOptions, response: str, metadata: dict, index: int) -> tuple[float, Any]:
    """(1.0 if options.pattern is found in the response else 0.0, the matched text or None); no ground truth."""
    match = re.search(options.pattern, response)  # re caches the compiled pattern
    return float(match is not None), match.group(0) if match else None


def score_length_target(options: LengthTargetOptions, response: str, metadata: dict, index: int) -> tuple[float, Any]:
    """(max(0, 1 - |len - target| / target), the response's length in characters); no ground truth."""
    length = len(response)
    return max(0.0, 1.0 - abs(length - options.target_chars) / options.target_chars), length


@dataclass
class AnswerReward:
    """A stateless rule reward: `score(options, response, metadata, index) -> (score, extracted)` per sample.
    Module-level score functions keep it picklable (a spawned process or a Ray actor may hold it)."""

    name: str
    options: Any
    score: Callable[[Any, str, dict, int], tuple[float, Any]]

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    def __call__(self, images: list[str], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        """images: the B decoded text responses (the RewardFunction slot images take). info["extracted"]: what
        was compared (the normalised answer, the parsed number, or the matched text), None where nothing was."""
        responses = to_texts(images)
        if len(metadata) != len(responses):
            raise ValueError(f"{self.name}: got {len(responses)} responses and {len(metadata)} metadata entries")
        scored = [self.score(self.options, text, meta, i) for i, (text, meta) in enumerate(zip(responses, metadata))]
        return RewardOutput(
            scores=torch.tensor([s for s, _ in scored], dtype=torch.float32),
            valid=torch.ones(len(scored), dtype=torch.bool),
            info={"extracted": [e for _, e in scored]},
        )


@register_reward("exact_match", options=ExactMatchOptions)
def exact_match(options: ExactMatchOptions) -> AnswerReward:
    """1.0 when the extracted (normalised) answer equals one accepted ground truth string, else 0.0."""
    return AnswerReward("exact_match", options, score_exact_match)


@register_reward("numeric_match", options=NumericMatchOptions)
def numeric_match(options: NumericMatchOptions) -> AnswerReward:
    """1.0 when the last number of the extracted answer is close to an accepted numeric ground truth, else 0.0."""
    return AnswerReward("numeric_match", options, score_numeric_match)


@register_reward("format_check", options=FormatCheckOptions)
def format_check(options: FormatCheckOptions) -> AnswerReward:
    """1.0 when `pattern` is found in the response (re.search), else 0.0; needs no ground truth."""
    return AnswerReward("format_check", options, score_format_check)


@register_reward("length_target", options=LengthTargetOptions)
def length_target(options: LengthTargetOptions) -> AnswerReward:
    """max(0, 1 - |characters - target_chars| / target_chars): varies on any response; needs no ground truth."""
    return AnswerReward("length_target", options, score_length_target)
