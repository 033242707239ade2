"""Environments for multi-turn, tool-calling rollouts (``rollout/multi_turn.py`` drives them).

An environment answers each assistant turn with tool (or user) messages, or says the trajectory is done;
the driver turns those messages into token ids through the chat template and never re-tokenizes what the
engine generated. ``rollout.environment`` names one by import path (``"package.module:Factory"``), like
``rollout.reward_fns``, and the same trust rule holds: an environment target is code that runs (its
module is imported and its tools are called on every assistant turn), so only use recipes and
environment modules you trust. ``resolve_environment`` refuses a target that does not build an object
with ``reset`` and ``step`` before any rollout starts.

Shipped: ``calculator:CalculatorEnv`` (the arithmetic / math rows; Qwen3 ``<tool_call>`` JSON calls,
evaluated by an AST walker, never ``eval``) and ``tool_replay:ToolReplayEnv`` (ToolAlpaca rows:
``Action`` / ``Action Input`` calls answered from the row's recorded calls).
"""

from srpo_megatron.rollout.environments.base import (
    Environment,
    EnvironmentFactory,
    EnvStep,
    NotAnEnvironment,
    parse_tool_calls,
    resolve_environment,
)

__all__ = [
    "EnvStep",
    "Environment",
    "EnvironmentFactory",
    "NotAnEnvironment",
    "parse_tool_calls",
    "resolve_environment",
]
