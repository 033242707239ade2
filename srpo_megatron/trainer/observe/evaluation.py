"""Held-out evaluation during training: avg@k (paper settings) and greedy accuracy, on rank 0's engine.

Fidelity fix: the budget report ("best avg@k within N hours") reads the training clock written with
each evaluation. That clock is a ``BudgetClock``: it starts when training starts, is saved in every
checkpoint (``trainer_state.json`` ``budget_clock_s``) and continues from there after a resume, so a
resumed run's hours count the time already spent instead of restarting from zero.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from srpo_megatron.evaluation.avg_at_k import greedy_accuracy, run_eval
from srpo_megatron.evaluation.budget_report import append_eval_log
from srpo_megatron.rollout.multi_turn import multi_turn_rollout


class BudgetClock:
    """Training wall-clock seconds, continuing across resumes."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._offset, self._t0 = float(start_s), time.monotonic()

    def elapsed(self) -> float:
        return self._offset + time.monotonic() - self._t0


def evaluate_policy(
    cfg: Any, engine: Any, tokenizer: Any, run_dir: Path, step: int, clock: BudgetClock
) -> dict | None:
    """Evaluate the weights the engine serves (== the trainer's). Returns a small summary on rank 0."""
    if engine is None:
        return None
    out = run_dir / "eval" / f"step_{step:06d}"
    # Only rank 0 evaluates: a refusal here would leave the other ranks waiting, so an evaluation whose
    # rewards all failed is the warning line (the steps themselves refuse it, rewards/failures.py).
    mt = multi_turn_rollout(cfg, tokenizer)  # as training's rollouts
    avg = run_eval(
        engine,
        tokenizer,
        cfg.data,
        cfg.eval,
        out / "avg_at_k",
        step=step,
        allow_reward_errors=True,
        multi_turn=mt,
    )
    append_eval_log(run_dir, avg, step, clock.elapsed())
    result = {"step": step, f"avg@{cfg.eval.k}": avg["mean_avg_at_k"]}
    if cfg.train.eval_greedy:
        result["greedy"] = greedy_accuracy(engine, tokenizer, cfg, out / "greedy", step, True)
    print(
        f"[eval] step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in result.items() if k != "step"),
        flush=True,
    )
    return result
