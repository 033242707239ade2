"""The synthetic arithmetic task: exact answers, seeded, and train/held-out never overlap."""

from __future__ import annotations

import re

import pytest

from srpo_megatron.data.arithmetic import generate_arithmetic_rows, problem_split
from srpo_megatron.rewards import get_reward_fn


def reference_answer(prompt: str) -> int:
    """Worked out independently from the prompt text (not from the generator's key)."""
    m = re.search(r"(?:What is|Compute|Calculate) (.+?)[?.] (?:Answer|Think)", prompt)
    if m:
        expr = m.group(1)
        assert re.fullmatch(r"[\d\s+\-*()]+", expr)
        return int(eval(expr, {"__builtins__": {}}))
    nums = [int(x) for x in re.findall(r"\d+", prompt)]
    if "gives away" in prompt:
        return nums[0] + nums[1] - nums[2]
    if "boxes of" in prompt:
        return nums[0] + nums[1] * nums[2]
    if "pages a day" in prompt:
        return nums[0] * nums[1] + nums[2]
    raise AssertionError(f"unrecognised prompt {prompt!r}")


@pytest.mark.parametrize("difficulty", [0, 1, 2, 3, 4, 5])
def test_answers_are_exact_and_verifiable(difficulty):
    rows = generate_arithmetic_rows("train", 200, difficulty, seed=5)
    assert len(rows) == 200
    for r in rows:
        assert r["kind"] == "arithmetic" and r["system"] is None
        assert int(r["answer"]) == reference_answer(r["prompt"]) and int(r["answer"]) >= 0
        assert r["prompt"].endswith("Answer with just the number.")
        assert get_reward_fn("arithmetic")(r["answer"], r["answer"]) == 1.0


@pytest.mark.parametrize("difficulty", [0, 1, 2, 3, 4, 5])
def test_train_and_held_out_never_overlap(difficulty):
    train_keys, test_keys = set(), set()
    for seed in range(4):
        train_keys |= {r["key"] for r in generate_arithmetic_rows("train", 300, difficulty, seed)}
        test_keys |= {r["key"] for r in generate_arithmetic_rows("test", 60, difficulty, seed)}
    assert train_keys and test_keys and not train_keys & test_keys
    assert all(problem_split(k) == "train" for k in train_keys)
    # Overlap also checked on the computation, not only on our key: same operands and operator.
    canon = lambda k: k.split("/", 1)[1]  # noqa: E731
    assert not {canon(k) for k in train_keys} & {canon(k) for k in test_keys}


def test_seeded_and_distinct_and_difficulty_changes_the_problems():
    a = generate_arithmetic_rows("test", 50, 0, seed=1)
    assert a == generate_arithmetic_rows("test", 50, 0, seed=1)
    assert a != generate_arithmetic_rows("test", 50, 0, seed=2)
    assert len({r["prompt"] for r in a}) == 50
    easy = generate_arithmetic_rows("train", 100, 0, 0)
    hard = generate_arithmetic_rows("train", 100, 1, 0)
    assert max(int(r["answer"]) for r in easy) <= 40 < max(int(r["answer"]) for r in hard)
    with pytest.raises(ValueError, match="difficulty=9"):
        generate_arithmetic_rows("train", 1, 9)


def test_reasoning_prompt_same_problems_other_instruction():
    plain = generate_arithmetic_rows("test", 40, 4, seed=3)
    think = generate_arithmetic_rows("test", 40, 4, seed=3, reasoning=True)
    assert [r["key"] for r in plain] == [r["key"] for r in think]
    assert [r["answer"] for r in plain] == [r["answer"] for r in think]
    for r in think:
        assert r["prompt"].endswith("? Think step by step, then give the final number.")
        assert "Answer with just" not in r["prompt"]
        assert int(r["answer"]) == reference_answer(r["prompt"])


def test_level4_holds_enough_distinct_held_out_problems_for_the_study():
    # The study evaluates on >= 256 distinct held-out problems; level 0 has only ~60 of them.
    rows = generate_arithmetic_rows("test", 300, 4, seed=0)
    assert len({r["key"] for r in rows}) == 300
    assert max(int(r["answer"]) for r in rows) <= 100
    assert len({r["key"] for r in generate_arithmetic_rows("test", 300, 0, seed=0)}) < 100


def test_level5_is_level0s_problems_with_half_held_out():
    """Level 0's difficulty (operands 1..20) with >= 256 distinct held-out problems; its own split."""
    test = generate_arithmetic_rows("test", 256, 5, seed=0)
    train = generate_arithmetic_rows("train", 256, 5, seed=0)
    assert len({r["key"] for r in test}) == 256 and len({r["key"] for r in train}) == 256
    nums = [int(x) for r in test + train for x in re.findall(r"\d+", r["prompt"])]
    assert max(nums) <= 20 and min(nums) >= 1
    space = {
        r["key"].split("/", 1)[1]
        for s in range(8)
        for sp in ("train", "test")
        for r in generate_arithmetic_rows(sp, 300, 5, s)
    }
    held = sum(problem_split(f"5/{k}") == "test" for k in space)
    assert 0.4 < held / len(space) < 0.6  # planted 10 % (level 0's share) gives ~0.1
    assert held / len(space) > 2 * sum(problem_split(f"0/{k}") == "test" for k in space) / len(space)
