"""Multiple-choice reward (SciKnowEval, the paper's rule).

1.0 iff the text inside the LAST ``<answer>…</answer>`` pair, stripped of surrounding whitespace, equals
the gold letter exactly (case-sensitive, as in SDPO's reference). No tag -> 0.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_mcq_answer(response: str) -> str | None:
    """The stripped text of the last complete ``<answer>…</answer>`` block, or None."""
    found = _ANSWER.findall(response)
    return found[-1].strip() if found else None


def mcq_reward(response: str, answer: str) -> float:
    picked = extract_mcq_answer(response)
    return 1.0 if picked is not None and picked == answer.strip() else 0.0
