"""The reward registry: reward kinds -> ``"module:function"`` names, resolved and signature-checked on first
use (the package docstring says why by name). A leaf of ``rewards/``: the pool and the package import it.
"""

from __future__ import annotations

import importlib
import inspect
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


class NotARewardFunction(TypeError):
    """The target imports but cannot be called as ``fn(response, answer)``; the message says why."""


def check_reward_signature(fn: object) -> None:
    """Raise ``NotARewardFunction`` unless ``fn`` is callable with two positional arguments."""
    if not callable(fn):
        raise NotARewardFunction(f"it is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise NotARewardFunction(
            "its signature cannot be read (a builtin?); wrap it in a Python function (response, answer)"
        ) from None
    try:
        sig.bind("", "")
    except TypeError as e:
        raise NotARewardFunction(
            f"its signature {sig} does not take (response, answer) ({e}); a reward function is "
            "fn(response: str, answer: str) -> float"
        ) from None


def resolve_reward(target: str) -> RewardFn:
    """The function ``target`` names, checked (``check_reward_signature``) before anything calls it."""
    fn = resolve_target(target)
    check_reward_signature(fn)
    return fn


def get_reward_fn(kind: str) -> RewardFn:
    """The reward function of ``kind``; unknown kinds raise a KeyError listing the registered ones."""
    return resolve_reward(reward_target(kind))
