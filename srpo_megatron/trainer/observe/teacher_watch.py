""" "Teacher moved?": the trend of the student–teacher divergence on SDPO tokens, and a warning when the
SDPO signal goes inert (pure bookkeeping on rank 0's step metrics; no tensors, no collectives).

SDPO learns from the teacher's divergence from the student on the SDPO tokens (``teacher/divergence_mean``).
miles found on-policy distillation inert when teacher ≈ student: the loss and its gradient vanish while
the run looks healthy. The EMA teacher trails the student, so a divergence that decays towards 0 while
SDPO tokens keep coming means the SDPO branch has stopped teaching.

- ``teacher/divergence_trend``: the least-squares slope of ``teacher/divergence_mean`` per step over the
  last ``WINDOW`` steps that had SDPO tokens (steps without any are skipped: their divergence is 0 by
  definition, not a measurement). Logged once two such steps exist; negative = teacher and student
  converging.
- The warning: one line, once per run, when ``teacher/divergence_mean`` stayed below ``INERT_BELOW`` for
  ``INERT_STEPS`` consecutive steps with SDPO tokens.

The window, the count of inert steps and whether the warning was given travel in the checkpoint
(``TrainerState.teacher_watch``), so a resumed run logs the same trend as an uninterrupted one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

WINDOW = 10  # steps in the trend's least-squares fit
INERT_BELOW = 1e-4  # nats per SDPO token: teacher and student agree to within float noise of a bf16 run
INERT_STEPS = 5  # consecutive SDPO steps below it before the warning


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, ..., n − 1 (n ≥ 2)."""
    n = len(ys)
    if n < 2:
        raise ValueError(f"a slope needs at least 2 points, got {n}")
    mx = (n - 1) / 2
    my = sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


class TeacherWatch:
    """Feed it each step's metrics (``observe``); it returns the trend metric and warns once via ``log``."""

    def __init__(
        self,
        log: Callable[[str], None],
        window: int = WINDOW,
        inert_below: float = INERT_BELOW,
        inert_steps: int = INERT_STEPS,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        if window < 2 or inert_steps < 1 or inert_below < 0:
            raise ValueError(
                f"TeacherWatch(window={window}, inert_steps={inert_steps}, inert_below={inert_below}): "
                "window must be >= 2, inert_steps >= 1 and inert_below >= 0"
            )
        self._log = log
        self._history: deque[float] = deque(maxlen=window)
        self._inert_below, self._inert_steps = inert_below, inert_steps
        self._below = 0
        self.warned = False
        if state is not None:  # a resumed run: the saved ``state_dict()``
            self._history.extend(float(v) for v in state["history"])
            self._below, self.warned = int(state["below"]), bool(state["warned"])

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): the window, the inert-step count, whether it warned."""
        return {"history": list(self._history), "below": self._below, "warned": self.warned}

    def observe(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """``teacher/divergence_trend`` for this step ({} until two SDPO steps were seen)."""
        if not metrics.get("tokens/sdpo_frac", 0.0):  # no SDPO token: nothing measured this step
            return {}
        div = float(metrics["teacher/divergence_mean"])
        self._history.append(div)
        self._below = self._below + 1 if div < self._inert_below else 0
        if self._below >= self._inert_steps and not self.warned:
            self.warned = True
            self._log(
                f"warning: step {step}: the SDPO signal looks inert: teacher/divergence_mean stayed below "
                f"{self._inert_below:g} for {self._below} steps with SDPO tokens (teacher ≈ student, the "
                "SDPO loss has ~no gradient); consider a smaller teacher.ema_alpha or teacher.kind=frozen"
            )
        if len(self._history) < 2:
            return {}
        return {"teacher/divergence_trend": slope(list(self._history))}
