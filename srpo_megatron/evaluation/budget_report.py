"""The paper's headline report: the best avg@k reached within given wall-clock budgets of training.

The trainer appends one line per evaluation to ``<run_dir>/eval_log.jsonl`` with ``append_eval_log``
(step, training wall-clock seconds so far, mean avg@k, per-benchmark avg@k). ``best_within_budgets``
reads it back and, for each budget (hours), reports the highest mean avg@k among evaluations done
within the budget (and where it was reached), and each benchmark's own highest avg@k within the budget.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EVAL_LOG = "eval_log.jsonl"


def append_eval_log(run_dir: str | Path, summary: dict[str, Any], step: int, elapsed_s: float) -> Path:
    """Append one evaluation (an ``evaluate`` summary) to ``<run_dir>/eval_log.jsonl``."""
    path = Path(run_dir) / EVAL_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {
        "step": step,
        "elapsed_s": float(elapsed_s),
        "mean_avg_at_k": summary["mean_avg_at_k"],
        "benchmarks": {name: b["avg_at_k"] for name, b in summary["benchmarks"].items()},
        "k": summary.get("k"),
    }
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    return path


def read_eval_log(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():
        path = path / EVAL_LOG
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no eval log; the trainer writes it when eval.every_n_steps > 0")
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def best_within_budgets(path: str | Path, budgets_hours: Sequence[float]) -> list[dict[str, Any]]:
    """One entry per budget: best mean avg@k within it (step, hours) and per-benchmark bests.

    A budget with no evaluation inside it reports ``None`` values.
    """
    entries = read_eval_log(path)
    report = []
    for hours in budgets_hours:
        inside = [e for e in entries if e["elapsed_s"] <= hours * 3600.0]
        if not inside:
            report.append(
                {"budget_h": hours, "mean_avg_at_k": None, "step": None, "hours": None, "benchmarks": {}}
            )
            continue
        # Ties go to the earliest evaluation (reached sooner).
        best = max(inside, key=lambda e: (e["mean_avg_at_k"], -e["elapsed_s"]))
        names = sorted({n for e in inside for n in e["benchmarks"]})
        report.append(
            {
                "budget_h": hours,
                "mean_avg_at_k": best["mean_avg_at_k"],
                "step": best["step"],
                "hours": best["elapsed_s"] / 3600.0,
                "benchmarks": {
                    n: max(e["benchmarks"][n] for e in inside if n in e["benchmarks"]) for n in names
                },
            }
        )
    return report


def format_budget_report(report: list[dict[str, Any]]) -> str:
    """A plain-text table: one row per budget, avg@k in percent like the paper."""
    names = sorted({n for r in report for n in r["benchmarks"]})
    head = ["budget", "mean", "step", *names]
    rows = [head]
    for r in report:
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
        rows.append(
            [f"{r['budget_h']:g} h", pct(r["mean_avg_at_k"]), "-" if r["step"] is None else str(r["step"])]
            + [pct(r["benchmarks"].get(n)) for n in names]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def budget_report_main(run_dir: str, budgets_hours: Sequence[float] = (1.0, 5.0, 10.0)) -> int:
    """Print the best-avg@k-within-budget table of a run (``srpo report RUN_DIR``, if the CLI wires it)."""
    print(format_budget_report(best_within_budgets(run_dir, budgets_hours)))
    return 0
