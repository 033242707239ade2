"""Verifiable rewards: typed ``(response: str, answer: str) -> float`` functions registered by kind.

``get_reward_fn(kind)`` returns the function; ``RewardPool`` scores batches in worker processes with a
per-sample timeout (an exception or a timeout gives reward 0 and is counted, never a failed step).
Functions are registered as ``"module:function"`` strings and imported on first use, so worker
processes resolve the same function by name and ``math-verify`` is only imported when math is scored.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, str] = {
    "mcq": "srpo_megatron.rewards.mcq:mcq_reward",
    "tooluse": "srpo_megatron.rewards.tooluse:tooluse_reward",
    "math": "srpo_megatron.rewards.math:math_reward",
    "arithmetic": "srpo_megatron.rewards.arithmetic:arithmetic_reward",
}


def registered_kinds() -> list[str]:
    """The reward kinds rows may name."""
    return sorted(_REGISTRY)


def register_reward(kind: str, target: str | RewardFn) -> None:
    """Register ``kind`` -> a module-level function (or its ``"module:function"`` name)."""
    if not isinstance(target, str):
        target = f"{target.__module__}:{target.__qualname__}"
    if ":" not in target:
        from srpo_megatron.config import ConfigError

        raise ConfigError(f"reward target {target!r} must look like 'package.module:function'")
    _REGISTRY[kind] = target


def reward_target(kind: str) -> str:
    """The ``"module:function"`` name registered for ``kind``."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise KeyError(
            f"unknown reward kind {kind!r}; registered kinds are {registered_kinds()} "
            "(register more with srpo_megatron.rewards.register_reward)"
        ) from None


def resolve_target(target: str) -> RewardFn:
    module, _, name = target.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn  # type: ignore[return-value]


def get_reward_fn(kind: str) -> RewardFn:
    """The reward function of ``kind``; unknown kinds raise a KeyError listing the registered ones."""
    return resolve_target(reward_target(kind))


from srpo_megatron.rewards.pool import RewardPool, RewardResult  # noqa: E402

__all__ = [
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "get_reward_fn",
    "register_reward",
    "registered_kinds",
    "reward_target",
]
