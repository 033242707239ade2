"""Reward of the synthetic arithmetic task: the response's final number equals the integer answer.

The final number is the last integer or decimal in the response (thousands separators ``1,234`` are
accepted); it must equal the gold integer exactly (``12.0`` counts as 12, ``12.5`` does not).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def extract_final_number(response: str) -> Fraction | None:
    found = _NUMBER.findall(response)
    if not found:
        return None
    return Fraction(found[-1].replace(",", ""))


def arithmetic_reward(response: str, answer: str) -> float:
    value = extract_final_number(response)
    return 1.0 if value is not None and value == int(answer.strip()) else 0.0
