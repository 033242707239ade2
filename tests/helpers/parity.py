"""The independent float64 reference of the top-K parity KL (``losses/parity.py``), shared by the unit and
dist tests."""

from __future__ import annotations

import math


def reference_kl(p_logp: list[float], q_logp: list[float]) -> float:
    """KL over the K ids and one tail bucket, in Python floats (float64), written out term by term."""
    p = [math.exp(x) for x in p_logp]
    q = [math.exp(x) for x in q_logp]
    head = sum(pk * (lp - lq) for pk, lp, lq in zip(p, p_logp, q_logp, strict=True))
    pt, qt = max(1.0 - sum(p), 1e-30), max(1.0 - sum(q), 1e-30)
    return head + pt * (math.log(pt) - math.log(qt))
