"""Verifiable rewards: typed ``(response: str, answer: str) -> float`` functions registered by kind.

``get_reward_fn(kind)`` returns the function; ``RewardPool`` scores batches in worker processes with a
per-sample timeout (an exception or a timeout gives reward 0 and is counted, never a failed step).
Functions are registered as ``"module:function"`` strings and imported on first use, so worker
processes resolve the same function by name and ``math-verify`` is only imported when math is scored.

A reward target is code that runs: ``rollout.reward_fns`` may name any importable function, and the
trainer imports its module and calls it on every response. Only use recipes (and reward modules) you
trust. ``resolve_reward`` refuses a target that cannot be called as ``fn(response, answer)`` (e.g.
``os:system``) before anything calls it.
"""

from srpo_megatron.rewards.pool import RewardPool, RewardResult
from srpo_megatron.rewards.registry import (
    NotARewardFunction,
    RewardFn,
    get_reward_fn,
    register_reward,
    registered_kinds,
    resolve_reward,
    reward_target,
)

__all__ = [
    "NotARewardFunction",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "get_reward_fn",
    "register_reward",
    "registered_kinds",
    "resolve_reward",
    "reward_target",
]
