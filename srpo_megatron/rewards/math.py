"""Math reward: math-verify equivalence of the response's final answer with the gold answer.

- Gold answers may be bare (``1/2``, ``\\frac{1}{2}``, ``0.5``), boxed, or GSM8K solutions ending in
  ``#### 42`` (the text after the last ``####`` is the answer).
- The response is parsed as math-verify does by default (boxed answers first, then any LaTeX or plain
  expression); a ``#### 42`` tail in the response is treated like ``\\boxed{42}``. Several different
  boxed answers are read as one set (math-verify's ``boxed="all"``), so hedging ``\\boxed{3} …
  \\boxed{4}`` matches neither 3 nor 4.
- math-verify's own timeouts use ``signal.alarm`` and only work on the main thread, so they are turned
  off here (``parsing_timeout=None``, ``timeout_seconds=None``); the per-call timeout is enforced by the
  caller (``RewardPool`` kills a worker that overruns and scores the sample 0).
"""

from __future__ import annotations

from math_verify import parse, verify


def _gold_text(answer: str) -> str:
    answer = answer.strip()
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip()
    if "\\boxed" in answer or "$" in answer:
        return answer
    return f"${answer}$"


def _response_text(response: str) -> str:
    if "\\boxed" not in response and "####" in response:
        tail = response.rsplit("####", 1)[1].strip().splitlines()
        if tail:
            return f"\\boxed{{{tail[0].strip().rstrip('.')}}}"
    return response


def math_reward(response: str, answer: str) -> float:
    gold = parse(_gold_text(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the gold answer {answer!r}")
    pred = parse(_response_text(response), parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
