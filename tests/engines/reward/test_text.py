"""Text matching: Levenshtein against hand-computed values, the OCR similarity formula, targets."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffrl.engines.reward.text import levenshtein, normalize_text, target_text, text_similarity


@pytest.mark.parametrize(
    "a, b, distance",
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("flaw", "lawn", 2),  # -f, +n
        ("hiddentrail", "hiddentrial", 2),  # swapped letters = 2 substitutions
        ("abc", "abc", 0),
        ("intention", "execution", 5),
    ],
)
def test_levenshtein_hand_values(a, b, distance):
    assert levenshtein(a, b) == distance


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.text(alphabet="abc", max_size=8), st.text(alphabet="abc", max_size=8))
def test_levenshtein_is_a_metric_bounded_by_lengths(a, b):
    d = levenshtein(a, b)
    assert d == levenshtein(b, a)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    assert (d == 0) == (a == b)


def test_text_similarity_formula():
    assert normalize_text(" Hidden\tTrail \n") == "hiddentrail"
    assert text_similarity("Hidden Trail", "the HIDDEN trail marker") == 1.0  # substring after normalising
    assert text_similarity("Hidden Trail", "Hiden Trail") == pytest.approx(1 - 1 / 11)
    assert text_similarity("abc", "") == 0.0  # distance 3 capped at len(target)
    assert text_similarity("abc", "xyzxyzxyz") == 0.0
    with pytest.raises(ValueError, match="empty"):
        text_similarity("  ", "anything")


def test_target_text_prefers_ground_truth_then_first_quotes():
    prompt = 'A wooden trail marker with "Hidden Trail" carved, and "Other" below'
    assert target_text(prompt, {}) == "Hidden Trail"
    assert target_text(prompt, {"ground_truth": "Exit"}) == "Exit"
    assert target_text("no quotes here", {}) is None
