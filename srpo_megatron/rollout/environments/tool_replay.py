"""ToolAlpaca-style tool calls replayed against the row's recorded calls.

A ToolAlpaca row's ``answer`` is the list of calls the reference made, ``[{"Action": name,
"Action_Input": json-string, "Observation"?: recorded response}]`` (``rewards/tooluse.py``). The model
writes ToolAlpaca's format (``Action: name`` then ``Action Input: {...}``); each call whose name and
input (parsed JSON, compared as objects) equal a not-yet-used recorded call gets that call's recorded
``Observation`` back (rows without one get ``RECORDED_OK``), and any other call gets an error
observation (a tool error: the model's mistake, shown to it). A turn without an ``Action`` is the final
answer: the trajectory is done. The row's verifier (``tooluse``) scores the assistant turns' text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from srpo_megatron.rollout.environments.base import EnvStep

_CALL = re.compile(r"Action:\s*(\w+)\s*(?:Action Input:\s*(\{.*?\}))?", re.DOTALL)
RECORDED_OK = '{"status": "success"}'  # the observation of a matching call whose row recorded none


def _as_object(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return None
    return raw


class ToolReplayEnv:
    """One trajectory's replay of a ToolAlpaca row's recorded calls (each recorded call answers once)."""

    def __init__(self) -> None:
        self._recorded: list[dict[str, Any]] = []

    def reset(self, row: Any) -> list[dict[str, str]]:
        calls = json.loads(row.answer)
        if not isinstance(calls, list):
            raise ValueError(f"{row.source}: a ToolAlpaca answer is a JSON list of calls, got {row.answer!r}")
        self._recorded = [dict(c) for c in calls]
        return []

    def _answer(self, name: str, raw_input: str | None) -> tuple[str, bool]:
        """The observation of one call, and whether it is an error."""
        given = _as_object(raw_input) if raw_input is not None else {}
        if given is None:
            return "Observation: error: the Action Input is not JSON", True
        for k, call in enumerate(self._recorded):
            if str(call.get("Action")) == name and _as_object(call.get("Action_Input", "{}")) == given:
                self._recorded.pop(k)
                return f"Observation: {call.get('Observation', RECORDED_OK)}", False
        return f"Observation: error: no recorded response for {name} with this input", True

    def step(self, assistant_text: str) -> EnvStep:
        calls = _CALL.findall(assistant_text)
        if not calls:
            return EnvStep(done=True)
        messages, errors = [], 0
        for name, raw_input in calls:
            text, error = self._answer(name, raw_input or None)
            errors += error
            messages.append({"role": "tool", "content": text})
        return EnvStep(messages, tool_calls=len(calls), tool_errors=errors)
