"""RewardPool: rewards in input order; exceptions and timeouts give 0 and are counted, never raised."""

from __future__ import annotations

import time

import pytest

from srpo_megatron.rewards import RewardPool, get_reward_fn, register_reward


def slow_reward(response: str, answer: str) -> float:
    """Hangs when asked to (stands in for sympy stuck on an adversarial expression)."""
    if response == "hang":
        time.sleep(60)
    return 1.0 if response == answer else 0.0


def raising_reward(response: str, answer: str) -> float:
    raise ValueError("cannot parse the gold answer")


register_reward("test_slow", slow_reward)
register_reward("test_raise", raising_reward)


def test_unknown_kind_lists_registered_kinds():
    with pytest.raises(KeyError, match=r"unknown reward kind 'nope'.*arithmetic.*math.*mcq.*tooluse"):
        get_reward_fn("nope")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pool_scores_in_order_and_survives_timeouts_and_errors(num_workers):
    kinds = ["arithmetic", "test_slow", "mcq", "test_raise", "test_slow", "math", "test_slow"]
    responses = ["12", "hang", "<answer>B</answer>", "x", "ok", r"\boxed{1/2}", "no"]
    answers = ["12", "x", "B", "x", "ok", "0.5", "yes"]
    with RewardPool(num_workers=num_workers, timeout_s=1.5) as pool:
        t0 = time.monotonic()
        res = pool.score(kinds, responses, answers)
        elapsed = time.monotonic() - t0
        assert res.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
        assert (res.num_timeouts, res.num_errors) == (1, 1)
        assert res.metrics()["reward/timeouts"] == 1.0 and res.metrics()["reward/errors"] == 1.0
        assert any("cannot parse the gold answer" in e for e in res.errors)
        assert elapsed < 30  # the hanging sample was abandoned, not waited for
        # The pool keeps working after a worker was killed.
        again = pool.score(["test_slow", "arithmetic"], ["a", "7"], ["a", "8"])
        assert again.rewards == [1.0, 0.0] and again.num_timeouts == 0


def test_pool_rejects_unknown_kind_before_scoring():
    with RewardPool(num_workers=0) as pool, pytest.raises(KeyError, match="registered kinds"):
        pool.score(["mcq", "bogus"], ["a", "b"], ["A", "B"])
