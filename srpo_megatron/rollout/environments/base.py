"""The environment interface: ``reset(row) -> messages``, ``step(assistant_text) -> EnvStep``.

One environment object serves one trajectory (the driver builds a fresh one per sample from the
registered factory), so it may keep per-trajectory state (which recorded calls were already used).
``step`` gets the assistant turn's text (decoded from the engine's ids, for the tool's eyes only; the
trainer scores the ids) and answers the messages to append (role ``tool``, or ``user``) or ``done``,
with this turn's reward part and its tool-call counts. Bounds (per-call timeout, max turns, tool output
length) are the driver's, so no environment can hang or flood a step.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from srpo_megatron.rewards.registry import resolve_target

Message = dict[str, str]  # {"role": "tool" | "user", "content": ...}


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one assistant turn.

    messages: appended after the assistant turn (role ``tool`` or ``user``); empty when ``done``.
    done: the trajectory ends here (the final answer was given, or nothing more to do).
    reward: this turn's reward part (added to the trajectory's verifier reward; 0 = none).
    tool_calls / tool_errors: calls the turn made, and how many of them the tool answered with an error
        (a wrong call is the model's mistake, shown to it as the tool's output; not an environment fault).
    """

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment."""

    def reset(self, row: Any) -> list[Message]:
        """Messages to add after the prompt before the first turn (usually none): ``row`` is the data row
        (``data.rows.Row``: prompt, system, answer, kind)."""
        ...

    def step(self, assistant_text: str) -> EnvStep:
        """Answer one assistant turn."""
        ...


EnvironmentFactory = Callable[[], Environment]


class NotAnEnvironment(TypeError):
    """The target imports but does not build an environment; the message says why."""


def resolve_environment(target: str) -> EnvironmentFactory:
    """The factory ``target`` (``"package.module:ClassOrFunction"``) names, checked: callable with no
    arguments, and what it builds has ``reset`` and ``step`` (built once here to check)."""
    module, sep, name = target.partition(":")
    if not (sep and module and name):
        raise NotAnEnvironment(
            f"rollout.environment={target!r} must look like 'package.module:Factory' (e.g. "
            "'srpo_megatron.rollout.environments.calculator:CalculatorEnv')"
        )
    factory = resolve_target(target)
    if not callable(factory):
        raise NotAnEnvironment(f"rollout.environment={target!r} is a {type(factory).__name__}, not a factory")
    try:
        inspect.signature(factory).bind()
    except (TypeError, ValueError) as e:
        raise NotAnEnvironment(
            f"rollout.environment={target!r} cannot be called with no arguments ({e}); an environment "
            "factory is a class or function taking none, building one trajectory's environment"
        ) from None
    env = factory()
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise NotAnEnvironment(
            f"rollout.environment={target!r} builds a {type(env).__name__} without {missing}; an "
            "environment has reset(row) -> messages and step(assistant_text) -> EnvStep"
        )
    return factory  # type: ignore[return-value]


# Qwen3's tool-call format: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments``, or ``error`` when the block is not a valid call."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text`` (Qwen3's format),
    in order; a block that is not such a JSON object comes back with ``error`` set."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"the tool call is not JSON ({e.msg})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall(error='a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = value.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        if not isinstance(args, dict):
            calls.append(ToolCall(name=value["name"], error="the tool call's arguments are not an object"))
            continue
        calls.append(ToolCall(value["name"], args))
    return calls
