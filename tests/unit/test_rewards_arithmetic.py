"""The arithmetic reward on generated rows: the response's last number equals the integer answer."""

from __future__ import annotations

import pytest

from srpo_megatron.data.arithmetic import generate_arithmetic_rows
from srpo_megatron.rewards import get_reward_fn

ROWS = {d: generate_arithmetic_rows("train", 8, difficulty=d, seed=3) for d in range(4)}

# (difficulty, row index, response template, expected); {v} is the row's answer, {w} = answer + 1.
CASES = [
    (0, 0, "{v}", 1.0),
    (0, 1, " {v}\n", 1.0),
    (0, 2, "The answer is {v}.", 1.0),
    (0, 3, "{w}", 0.0),
    (0, 4, "The answer is {w}.", 0.0),
    (0, 5, "", 0.0),
    (0, 6, "I don't know.", 0.0),
    (0, 7, "{v}.0", 1.0),  # 12.0 is the integer 12
    (0, 0, "{v}.5", 0.0),
    (1, 0, "Let me add: the result is {v}", 1.0),
    (1, 1, "{v} or maybe {w}", 0.0),  # the last number counts
    (1, 2, "{w}? No: {v}", 1.0),
    (1, 3, "**{v}**", 1.0),
    (1, 4, "= {v}", 1.0),
    (1, 5, "{v}!", 1.0),
    (2, 0, "{v}", 1.0),
    (2, 1, "Step 1 gives a number, step 2 gives {v}.", 1.0),
    (2, 2, "{v} (because 2 * 3 = 6)", 0.0),  # trailing working ends with another number
    (2, 3, "-{v}", 0.0),  # answers at level 2 are positive
    (2, 4, "{w}", 0.0),
    (3, 0, "{v} apples", 1.0),
    (3, 1, "The answer is: {v}", 1.0),
    (3, 2, "{w}", 0.0),
    (3, 3, "1,{v_pad3}", 0.0),  # 1,0xy is 10xy with a thousands separator, not the answer
    (3, 4, "{v}", 1.0),
    (3, 5, "answer: {v}\n", 1.0),
]


@pytest.mark.parametrize(("level", "i", "template", "expected"), CASES)
def test_arithmetic_reward_on_generated_rows(level, i, template, expected):
    row = ROWS[level][i]
    v = int(row["answer"])
    response = template.format(v=v, w=v + 1, v_pad3=f"{v:03d}")
    assert get_reward_fn("arithmetic")(response, row["answer"]) == expected


def test_thousands_separator_and_negative_answers():
    fn = get_reward_fn("arithmetic")
    assert fn("The total is 1,234.", "1234") == 1.0
    assert fn("-5", "-5") == 1.0
    assert fn("5", "-5") == 0.0


def test_enough_arithmetic_cases():
    assert len(CASES) >= 25
