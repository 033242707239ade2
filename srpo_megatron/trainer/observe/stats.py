"""The one rule that combines ``StepStats`` (``trainer/step_types.py``): each field by its declared reduction.

Used over a rank's mini-batches (the learning pass), over the CP group (``context_parallel``) and over
ranks (``step_metrics.gather_stats``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from srpo_megatron.trainer.step_types import SUM, StepStats


def reduce_stats(items: Iterable[StepStats]) -> StepStats:
    """Combine stats field by field with each field's declared reduction (the empty reduction is 0)."""
    out = StepStats()
    for item in items:
        for f in dataclasses.fields(StepStats):
            a, b = getattr(out, f.name), getattr(item, f.name)
            setattr(out, f.name, a + b if f.metadata["reduce"] == SUM else max(a, b))
    return out
