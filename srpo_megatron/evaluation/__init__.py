"""Evaluation: avg@k through any rollout engine, the best-within-budget report, and run plots."""

from srpo_megatron.evaluation.avg_at_k import build_eval_benchmarks, evaluate, run_eval
from srpo_megatron.evaluation.budget_report import (
    append_eval_log,
    best_within_budgets,
    budget_report_main,
    format_budget_report,
)
from srpo_megatron.evaluation.plots import plot_main, plot_run

__all__ = [
    "append_eval_log",
    "best_within_budgets",
    "budget_report_main",
    "build_eval_benchmarks",
    "evaluate",
    "format_budget_report",
    "plot_main",
    "plot_run",
    "run_eval",
]
