"""Best avg@k within wall-clock budgets, from a hand-written eval log with hand-worked expectations."""

from __future__ import annotations

import json

import pytest

from srpo_megatron.evaluation import append_eval_log, best_within_budgets, format_budget_report

H = 3600.0


def summary(mean, a, b):
    return {"mean_avg_at_k": mean, "k": 16, "benchmarks": {"a": {"avg_at_k": a}, "b": {"avg_at_k": b}}}


@pytest.fixture
def run_dir(tmp_path):
    # (step, hours, mean, a, b): the mean peaks at 0.6 (step 30, 2.5 h), then 0.7 at 9 h, 0.9 after 10 h.
    for step, hours, mean, a, b in [
        (0, 0.0, 0.30, 0.20, 0.40),
        (10, 0.9, 0.50, 0.70, 0.30),
        (20, 1.0, 0.50, 0.40, 0.60),
        (30, 2.5, 0.60, 0.50, 0.70),
        (40, 4.0, 0.55, 0.75, 0.35),
        (90, 9.0, 0.70, 0.60, 0.80),
        (100, 10.5, 0.90, 0.90, 0.90),
    ]:
        append_eval_log(tmp_path, summary(mean, a, b), step=step, elapsed_s=hours * H)
    return tmp_path


def test_best_within_budgets(run_dir):
    rep = best_within_budgets(run_dir, [0.5, 1, 5, 10])
    assert [(r["budget_h"], r["mean_avg_at_k"], r["step"]) for r in rep] == [
        (0.5, 0.30, 0),
        (1, 0.50, 10),  # a tie with step 20 goes to the earlier evaluation
        (5, 0.60, 30),
        (10, 0.70, 90),  # the 0.9 at 10.5 h is outside the budget
    ]
    # Per-benchmark bests are taken independently within the budget.
    assert rep[1]["benchmarks"] == {"a": 0.70, "b": 0.60}
    assert rep[2]["benchmarks"] == {"a": 0.75, "b": 0.70}
    assert rep[2]["hours"] == pytest.approx(2.5)


def test_empty_budget_and_text_table(run_dir, tmp_path):
    (tmp_path / "late").mkdir()
    append_eval_log(tmp_path / "late", summary(0.4, 0.4, 0.4), step=5, elapsed_s=2 * H)
    rep = best_within_budgets(tmp_path / "late" / "eval_log.jsonl", [1, 3])
    assert rep[0]["mean_avg_at_k"] is None and rep[1]["mean_avg_at_k"] == 0.4
    table = format_budget_report(best_within_budgets(run_dir, [1, 10])).splitlines()
    assert table[0].split() == ["budget", "mean", "step", "a", "b"]
    assert table[1].split() == ["1", "h", "50.0", "10", "70.0", "60.0"]
    assert table[2].split() == ["10", "h", "70.0", "90", "75.0", "80.0"]


def test_log_lines_are_plain_json(run_dir):
    first = json.loads((run_dir / "eval_log.jsonl").read_text().splitlines()[0])
    assert first == {
        "step": 0,
        "elapsed_s": 0.0,
        "mean_avg_at_k": 0.3,
        "benchmarks": {"a": 0.2, "b": 0.4},
        "k": 16,
    }
    with pytest.raises(FileNotFoundError, match="no eval log"):
        best_within_budgets(run_dir / "nowhere", [1])


def test_report_main_prints_the_table(run_dir, capsys):
    from srpo_megatron.evaluation import budget_report_main

    assert budget_report_main(str(run_dir), [5]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["5", "h", "60.0", "30", "75.0", "70.0"]
