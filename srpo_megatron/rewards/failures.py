"""The one rule for rewards that failed, shared by training (each step) and evaluation (each run).

A failing reward scores 0 and is counted, so one bad sample never fails a step or an evaluation. A reward
that fails on most samples is a broken verifier, not noise, and a step or an evaluation whose rewards all
failed measures nothing (every advantage 0, every avg@k 0.0):

- more than half of the rewards failed: one warning line with the count and the first distinct messages
  (each names the reward kind and its ``module:function`` target);
- every reward failed: ``RewardsFailed`` (one line, exit status 2), unless the recipe sets
  ``rollout.allow_reward_errors: true`` (then the warning only).

Timeouts count as failures, as errors do.
"""

from __future__ import annotations

from collections.abc import Callable

from srpo_megatron.config import ConfigError

SHOWN = 3  # distinct messages quoted in the line


class RewardsFailed(ConfigError):
    """Every reward of a step or an evaluation failed; the message names the reward kinds, targets and
    first errors."""


def first_distinct(messages: list[str], n: int = SHOWN) -> list[str]:
    """The first ``n`` distinct messages, in order."""
    return list(dict.fromkeys(messages))[:n]


def check_reward_failures(
    where: str,
    scored: int,
    failed: int,
    messages: list[str],
    allow_errors: bool,
    allowed_means: str,
    log: Callable[[str], None] = print,
) -> None:
    """Warn when more than half of ``scored`` rewards ``failed``; raise ``RewardsFailed`` when all did,
    unless ``allow_errors``. ``where`` names the step or evaluation, ``allowed_means`` what
    ``rollout.allow_reward_errors: true`` would do instead; ``messages`` are the pool's first errors."""
    if scored <= 0 or 2 * failed <= scored:
        return
    quoted = "; ".join(first_distinct(messages)) or "no message recorded"
    if failed >= scored and not allow_errors:
        raise RewardsFailed(
            f"every reward of {where} failed ({failed} of {scored}; first: {quoted}); fix the reward "
            f"function or rollout.reward_fns (rollout.allow_reward_errors: true {allowed_means})"
        )
    log(f"[srpo] warning: {failed} of {scored} rewards of {where} failed and scored 0 (first: {quoted})")
