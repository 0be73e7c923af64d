"""Text-matching helpers shared by the OCR reward and the VLM judge's transcription parser."""

from __future__ import annotations

import re

_QUOTED = re.compile(r'"([^"]*)"')


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost 1), two-row DP."""
    if len(a) < len(b):
        a, b = b, a  # keep the row as short as the shorter string
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(
                min(
                    previous[j] + 1,  # delete char_a
                    current[j - 1] + 1,  # insert char_b
                    previous[j - 1] + (char_a != char_b),  # substitute (free when equal)
                )
            )
        previous = current
    return previous[-1]


def normalize_text(text: str) -> str:
    """Lowercased, all whitespace removed: OCR spacing and case are not what we reward."""
    return "".join(text.lower().split())


def target_text(prompt: str, metadata: dict) -> str | None:
    """The text an image should show: metadata["ground_truth"] if present, else the text inside
    the first pair of double quotes in the prompt; None when neither exists."""
    ground_truth = metadata.get("ground_truth")
    if ground_truth is not None:
        return str(ground_truth)
    match = _QUOTED.search(prompt)
    return match.group(1) if match else None


def text_similarity(target: str, recognised: str) -> float:
    """1 if the normalised target is a substring of the normalised recognised text, else
    1 - min(levenshtein, len(target)) / len(target). Both normalised (see `normalize_text`)."""
    target_n, recognised_n = normalize_text(target), normalize_text(recognised)
    if not target_n:
        raise ValueError("target text is empty after normalisation; nothing to match against")
    if target_n in recognised_n:
        return 1.0
    distance = levenshtein(target_n, recognised_n)
    return 1.0 - min(distance, len(target_n)) / len(target_n)
