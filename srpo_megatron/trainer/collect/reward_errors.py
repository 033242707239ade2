"""Loud reward failures: what a step does when its reward functions raise or time out.

A failing reward scores 0 and is counted (``reward/errors``, ``reward/timeouts``), so one bad sample never
fails a step. A reward that fails on most samples is a broken verifier, not noise, and a step whose rewards
all failed trains on nothing (every advantage 0):

- more than half of a step's rewards failed: one warning line with the count and the first distinct
  messages (each names the reward kind and its ``module:function`` target);
- every reward of the step failed: the run stops with one line (``RewardsFailed``, exit status 2), unless
  the recipe sets ``rollout.allow_reward_errors: true`` (then the warning only).

Timeouts count as failures, as errors do. Rank 0 decides (it holds the reward pool); the rollout service
broadcasts the verdict so that every rank stops with the same line.
"""

from __future__ import annotations

from collections.abc import Callable

from srpo_megatron.config import ConfigError

SHOWN = 3  # distinct messages quoted in the line


class RewardsFailed(ConfigError):
    """Every reward of a step failed; the message names the reward kinds, targets and first errors."""


def first_distinct(messages: list[str], n: int = SHOWN) -> list[str]:
    """The first ``n`` distinct messages, in order."""
    return list(dict.fromkeys(messages))[:n]


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
    if scored <= 0 or 2 * failed <= scored:
        return
    where = f"step {step}" if step is not None else "this step"
    quoted = "; ".join(first_distinct(messages)) or "no message recorded"
    if failed >= scored and not allow_errors:
        raise RewardsFailed(
            f"every reward of {where} failed ({failed} of {scored}; first: {quoted}); fix the reward "
            "function or rollout.reward_fns (rollout.allow_reward_errors: true trains on with reward 0)"
        )
    log(f"[srpo] warning: {failed} of {scored} rewards of {where} failed and scored 0 (first: {quoted})")
