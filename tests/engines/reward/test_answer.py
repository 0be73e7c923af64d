"""Text-answer rewards of token rollouts: exact_match, numeric_match, format_check, length_target (closed-form
cases)."""

import math
import pickle

import numpy as np
import pytest
import torch

from diffrl.configs.reward import RewardConfig
from diffrl.engines.reward.answer import extract_answer, normalize_answer, parse_last_number, parse_numbers
from diffrl.engines.reward.base import build_reward, reward_names
from diffrl.engines.reward.multi import MultiReward


def _score(name: str, responses: list[str], truths: list, options: dict | None = None) -> list[float]:
    metadata = [{"ground_truth": t} for t in truths]
    out = build_reward(name, options or {})(responses, [""] * len(responses), metadata)
    assert out.scores.dtype == torch.float32 and out.valid.all() and len(out.info["extracted"]) == len(responses)
    return out.scores.tolist()


def test_registered_by_name():
    assert {"exact_match", "numeric_match", "format_check", "length_target"} <= set(reward_names())


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("  Paris  ", "paris"),  # strip
        ("PARİS Straße", "pari̇s strasse"),  # casefold (not lower: ß -> ss)
        ("New \t York\n City", "new york city"),  # whitespace runs -> one space
        ('"Paris."', "paris"),  # surrounding quotes and punctuation
        ("**(Paris)!**", "paris"),  # markdown emphasis and brackets
        ("-5", "-5"),  # a sign is meaning, not punctuation
        ("U.S.A.", "u.s.a"),  # inner punctuation stays
    ],
)
def test_normalisation_rules(raw, expected):
    assert normalize_answer(raw) == expected


def test_extraction_modes():
    text = "I think 3. Answer: 4 so \\boxed{\\frac{1}{2}} and <answer> 7 </answer>"
    assert extract_answer(text, "auto") == "\\frac{1}{2}"  # boxed first, nested braces matched
    assert extract_answer(text, "answer_tag") == " 7 "
    assert extract_answer("x answer: 5. ANSWER: 6", "marker") == " 6"  # last marker, case-insensitive
    assert extract_answer("Straße Answer: 6", "auto") == " 6"  # casefolding does not shift the index
    assert extract_answer("Final: 9", "auto", marker="Final:") == " 9"
    assert extract_answer("just 5", "auto") == "just 5"
    assert extract_answer("just 5", "boxed") is None and extract_answer("\\boxed{5", "boxed") is None
    assert extract_answer("just 5", "answer_tag") is None and extract_answer("just 5", "marker") is None
    assert extract_answer(text, "none") == text


def test_exact_match_scores():
    responses = [
        "The capital is Paris.",  # whole response: not equal
        "Reasoning... Answer:  paris. ",
        "so \\boxed{Paris}",
        "<think>hmm</think><answer>Lyon</answer>",
        "Answer: NYC",
        "no marker here",
    ]
    truths = ["Paris", "Paris", "paris", "Paris", ["New York", "nyc"], "Paris"]
    assert _score("exact_match", responses, truths) == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert _score("exact_match", ["Answer: 42"], [42]) == [1.0]  # a numeric ground truth compares as its str
    assert _score("exact_match", ["Answer: paris"], ["Paris"], {"normalize": False}) == [0.0]
    assert _score("exact_match", ["Answer:Paris"], ["Paris"], {"normalize": False}) == [1.0]
    out = build_reward("exact_match", {"extract": "boxed"})(["Answer: Paris"], [""], [{"ground_truth": "Paris"}])
    assert out.scores.tolist() == [0.0] and out.info["extracted"] == [None]  # no box: wrong, not excluded


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42.0),
        ("it is -17 degrees", -17.0),
        ("−3", -3.0),  # unicode minus
        ("+8", 8.0),
        ("costs $1,234,567.89 total", 1234567.89),
        ("3.25", 3.25),
        (".5", 0.5),
        ("3/4 of them", 0.75),
        ("-3/4", -0.75),
        ("\\frac{3}{8}", 0.375),
        ("1e-3", 0.001),
        ("50%", 50.0),
        ("first 3, then 1,2", 2.0),  # "1,2" is two numbers, not a thousands group
        ("x2 is not a number, 7 is", 7.0),
        ("1/0 then", None),  # a fraction over 0 is not a number
        ("no digits here", None),
    ],
)
def test_parse_last_number(text, value):
    assert parse_last_number(text) == value


def test_huge_numbers_parse_without_error():
    assert parse_last_number("1" * 6000) == math.inf  # beyond int()'s 4300-digit limit: inf, not a ValueError
    assert parse_numbers("1e999999999") == [math.inf]


def test_numeric_match_scores():
    responses = ["so 1,234 apples", "The answer is 0.75", "\\boxed{3/4} then 5", "about 100.001", "none", "-2"]
    truths = [1234, "3/4", 0.75, 100, 1, "-2"]
    assert _score("numeric_match", responses, truths) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert _score("numeric_match", ["about 100.001"], [100], {"rel_tol": 1e-4}) == [1.0]
    assert _score("numeric_match", ["0.001"], [0], {"abs_tol": 0.01}) == [1.0]
    assert _score("numeric_match", ["Answer: 7"], [["6", 7]]) == [1.0]  # a list of accepted numbers


def test_format_check_default_and_custom_pattern():
    responses = [
        "<think>step 1\nstep 2</think>\n<answer>42</answer>",
        "  <think></think> <answer>x</answer>\n",
        "<answer>42</answer>",  # no think
        "<think>a</think> prose <answer>42</answer>",  # text between the blocks
        "<think>a</think><answer>42</answer> trailing",
    ]
    out = build_reward("format_check", {})(responses, [""] * 5, [{}] * 5)  # needs no ground truth
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0] and out.info["extracted"][2] is None
    boxed = build_reward("format_check", {"pattern": r"\\boxed\{.+\}"})
    assert boxed(["so \\boxed{5}", "so 5"], ["", ""], [{}, {}]).scores.tolist() == [1.0, 0.0]


def test_length_target_is_linear_around_the_target():
    reward = build_reward("length_target", {"target_chars": 10})
    responses = ["x" * n for n in (0, 5, 10, 13, 20, 31)]
    out = reward(responses, [""] * 6, [{}] * 6)  # needs no ground truth
    assert out.scores.tolist() == pytest.approx([0.0, 0.5, 1.0, 0.7, 0.0, 0.0])
    assert out.info["extracted"] == [0, 5, 10, 13, 20, 31]
    with pytest.raises(ValueError, match="target_chars"):
        build_reward("length_target", {"target_chars": 0})


def test_multi_reward_takes_text_and_rewards_pickle():
    config = RewardConfig(
        components=[
            {"name": "format_check", "weight": 0.5},
            {"name": "numeric_match", "weight": 1.0},
        ]
    )
    reward = MultiReward(config)
    responses = ["<think>a</think><answer>12</answer>", "12", "<think>a</think><answer>13</answer>"]
    out = reward(responses, ["q"] * 3, [{"ground_truth": 12}] * 3)
    assert out.scores.tolist() == [1.5, 1.0, 0.5] and out.info["numeric_match/extracted"] == [12.0, 12.0, 13.0]
    restored = pickle.loads(pickle.dumps(reward.rewards["numeric_match"]))
    assert restored(["12"], [""], [{"ground_truth": 12}]).scores.tolist() == [1.0]


def test_bad_input_is_a_clear_error():
    reward = build_reward("exact_match", {})
    with pytest.raises(ValueError, match=r"exact_match: sample 1 has no metadata\['ground_truth'\]"):
        reward(["a", "b"], ["", ""], [{"ground_truth": "a"}, {}])
    with pytest.raises(ValueError, match="sample 0 has an empty list"):
        reward(["a"], [""], [{"ground_truth": []}])
    with pytest.raises(ValueError, match="sample 0 has a ground truth of type dict"):
        reward(["a"], [""], [{"ground_truth": {"a": 1}}])
    with pytest.raises(ValueError, match="sample 0 has ground truth 'seven', which is not exactly one finite number"):
        build_reward("numeric_match", {})(["7"], [""], [{"ground_truth": "seven"}])
    with pytest.raises(TypeError, match="response 1 is a int"):
        reward(["a", 3], ["", ""], [{"ground_truth": "a"}] * 2)
    with pytest.raises(TypeError, match="text responses must be a list of str, got ndarray"):
        reward(np.zeros((1, 8, 8, 3), dtype=np.uint8), [""], [{"ground_truth": "a"}])
    with pytest.raises(ValueError, match="got 2 responses and 1 metadata entries"):
        reward(["a", "b"], ["", ""], [{"ground_truth": "a"}])


def test_bad_options_fail_at_build():
    with pytest.raises(ValueError, match="option 'extract' must be one of auto, boxed, answer_tag, marker, none"):
        build_reward("exact_match", {"extract": "last_line"})
    with pytest.raises(ValueError, match="'pattern' is not a valid regex"):
        build_reward("format_check", {"pattern": "<think>("})
    with pytest.raises(ValueError, match="option 'rel_tol' must be >= 0"):
        build_reward("numeric_match", {"rel_tol": -1.0})
    assert build_reward("numeric_match", {"rel_tol": "0.01"}).options.rel_tol == 0.01  # CLI strings convert
