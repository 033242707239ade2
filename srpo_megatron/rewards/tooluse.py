"""Tool-use reward (ToolAlpaca, the paper's rule as in SDPO's reference).

1.0 iff both hold:
- the multiset of action names matched by ``Action:\\s*(\\w+)`` in the response equals the multiset of
  the reference's ``Action`` names;
- the dict merged (later keys win) from every JSON object after ``Action Input:`` — non-greedy
  ``{...}`` blocks, unparsable ones skipped — equals the dict merged from the reference's
  ``Action_Input`` JSON strings.

Faithful consequences worth knowing: a nested object in an Action Input is cut at its first ``}`` by the
non-greedy match and therefore skipped, so references with nested inputs can only be matched by a
response whose merged dict agrees anyway; and reference names like ``[Optional]foo`` can never match
``\\w+``. We keep the rule as published so scores compare with the paper.
"""

from __future__ import annotations

import json
import re
from collections import Counter

_ACTION = re.compile(r"Action:\s*(\w+)")
_ACTION_INPUT = re.compile(r"Action Input:\s*(\{.*?\})", re.DOTALL)


def _merged_inputs(blocks: list[str]) -> dict:
    merged: dict = {}
    for block in blocks:
        try:
            value = json.loads(block)
        except (json.JSONDecodeError, ValueError):
            continue
        if isinstance(value, dict):
            merged.update(value)
    return merged


def parse_reference(answer: str) -> tuple[Counter, dict]:
    """Reference actions (multiset) and merged inputs from the gold JSON list."""
    calls = json.loads(answer)
    actions = Counter(str(c["Action"]) for c in calls)
    inputs: dict = {}
    for c in calls:
        raw = c.get("Action_Input", "{}")
        try:
            value = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            inputs.update(value)
    return actions, inputs


def tooluse_reward(response: str, answer: str) -> float:
    ref_actions, ref_inputs = parse_reference(answer)
    actions = Counter(_ACTION.findall(response))
    if actions != ref_actions:
        return 0.0
    return 1.0 if _merged_inputs(_ACTION_INPUT.findall(response)) == ref_inputs else 0.0
