"""Answer extraction and the exact-match reward."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from rlhf_eqx import data


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("#### 1,450,000", "1450000"),
        ("#### -10", "-10"),
        ("#### $5", "5"),
        ("step 1 #### 3\nthen #### 4", "4"),  # the last marker wins
        ("#### 2.50", "2.5"),
        ("#### 7.00", "7"),
        ("The answer is 18.", None),
        ("#### unknown", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert data.extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So she earns 9 * 2 = 18 dollars.", "18"),
        ("It costs $1,200, not 1,000.", "1000"),
        ("The result is -3.", "-3"),
        ("x = 0.50", "0.5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_last_number(text, expected):
    assert data.extract_last_number(text) == expected


def test_exact_match_reward():
    completions = [
        "9 * 2 = 18. The answer is 18",
        "I think #### 18",
        "The answer is 19",
        "Eighteen",
        "#### 1,000 (check: 999 + 1)",
        "total 5.0",
    ]
    answers = ["18", "18", "18", "18", "1000", "5"]
    reward = data.exact_match_reward(completions, answers)
    assert reward.dtype == np.float32 and reward.shape == (6,)
    np.testing.assert_array_equal(reward, [1, 1, 0, 0, 1, 1])
    # A reference holding a whole GSM8K solution is compared by its final answer.
    solution = "She makes 9 * 2 = $<<9*2=18>>18.\n#### 1,018"
    got = data.exact_match_reward(["#### 1018", "1018", "18", solution], [solution] * 4)
    np.testing.assert_array_equal(got, [1, 1, 0, 1])
    # Non-numeric references are compared as text.
    np.testing.assert_array_equal(data.exact_match_reward(["#### 3"], ["three"]), [0.0])
    with pytest.raises(ValueError):
        data.exact_match_reward(["1"], ["1", "2"])


@given(st.integers(-(10**9), 10**9), st.integers(-(10**9), 10**9))
def test_exact_match_reward_integers(n, m):
    completion = f"Working... so the total is {n:,}."
    reward = data.exact_match_reward([completion, f"#### {n}"], [str(m), f"{m:,}"])
    expected = np.float32(n == m)
    np.testing.assert_array_equal(reward, [expected, expected])
