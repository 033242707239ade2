"""The math reward (math-verify equivalence). ../shared/data has no math rows, so gold answers are written
here in the styles math datasets use (bare, LaTeX, boxed, GSM8K ``#### n``); expectations by hand."""

from __future__ import annotations

import threading

import pytest

from srpo_megatron.rewards import get_reward_fn

CASES = [
    # boxed answers vs equivalent gold forms
    (r"So the answer is \boxed{1/2}.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{0.33}", "1/3", 0.0),  # not equal after rounding to 6 places
    (r"\boxed{41}", "42", 0.0),
    (r"\boxed{42}", "42", 1.0),
    (r"\boxed{-7}", "-7", 1.0),
    (r"\boxed{7}", "-7", 0.0),
    # GSM8K-style #### answers, in the gold and in the response
    ("Adding up, 40 + 2 = 42.\n#### 42", "42", 1.0),
    ("So she pays 18 dollars.", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", 1.0),
    ("#### 17", "#### 18", 0.0),
    ("The total is #### 1,000", "1000", 1.0),
    # algebraic equivalence
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{(x+1)(x-1)}", "x^2-1", 1.0),
    (r"\boxed{x^2+1}", "x^2-1", 0.0),
    (r"$\sqrt{2}$", r"\sqrt 2", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\pi}", "3.14159", 0.0),
    # plain-text final answers without a box
    ("The result is 7.", "7", 1.0),
    ("The final answer is $\\frac{5}{6}$", "5/6", 1.0),
    # malformed or missing answers
    ("I do not know.", "3", 0.0),
    ("", "3", 0.0),
    (r"\boxed{}", "3", 0.0),
    # several boxed answers: math-verify reads them all as one set, so hedging between two values fails
    (r"\boxed{4} ... checking again, \boxed{4}", "4", 1.0),
    (r"first \boxed{3}, then \boxed{4}", "3", 0.0),
    (r"first \boxed{3}, then \boxed{4}", "4", 0.0),
    # percentages and units
    (r"\boxed{50\%}", "50", 1.0),
]


@pytest.mark.parametrize(("response", "answer", "expected"), CASES)
def test_math_reward(response, answer, expected):
    assert get_reward_fn("math")(response, answer) == expected


def test_enough_math_cases():
    assert len(CASES) >= 25


def test_math_reward_works_off_the_main_thread():
    # math-verify's own signal-based timeout would raise off the main thread; ours is disabled there.
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", get_reward_fn("math")(r"\boxed{1/2}", "0.5")))
    th.start()
    th.join(60)
    assert out == {"r": 1.0}
