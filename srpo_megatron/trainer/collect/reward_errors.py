"""Loud reward failures in training: what a step does when its reward functions raise or time out.

The rule is ``rewards/failures.py`` (shared with ``srpo eval``): more than half of a step's rewards failed
is one warning line; every reward of the step failed stops the run with one line (``RewardsFailed``, exit
status 2), unless the recipe sets ``rollout.allow_reward_errors: true`` (then the warning only).

Rank 0 decides (it holds the reward pool); the rollout service broadcasts the verdict so that every rank
stops with the same line.
"""

from __future__ import annotations

from collections.abc import Callable

from srpo_megatron.rewards.failures import SHOWN, RewardsFailed, check_reward_failures, first_distinct

__all__ = ["SHOWN", "RewardsFailed", "check_step_rewards", "first_distinct"]


def check_step_rewards(
    step: int | None,
    scored: int,
    failed: int,
    messages: list[str],
    allow_errors: bool,
    log: Callable[[str], None] = print,
) -> None:
    """Warn when more than half of ``scored`` rewards ``failed``; raise ``RewardsFailed`` when all did,
    unless ``allow_errors``. ``messages`` are the pool's first error messages."""
    where = f"step {step}" if step is not None else "this step"
    check_reward_failures(where, scored, failed, messages, allow_errors, "trains on with reward 0", log)
