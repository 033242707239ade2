"""plot_run renders one readable PNG per metric group from metrics.jsonl, tolerating missing keys."""

from __future__ import annotations

import json
import math

import pytest

from srpo_megatron.evaluation import plot_run


def write_run(tmp_path, n=40):
    lines = []
    for step in range(n):
        rec = {"step": step, "reward/mean": 0.3 + 0.01 * step, "route/grpo_frac": 0.6 + 0.005 * step}
        rec["route/sdpo_frac"] = 1 - rec["route/grpo_frac"] - 0.05
        rec["route/fallback_frac"] = 0.05
        if step % 2 == 0:  # logged every other step only
            rec["teacher/entropy_mean"] = 1.5 + 0.02 * step
            rec["dw/w_tilde_mean"] = math.exp(-rec["teacher/entropy_mean"])
        rec["response/length_mean"] = 200 - step
        rec["time/generate_s"] = 8.0
        rec["time/train_s"] = 20.0 + (step % 3)
        rec["custom/thing"] = step * 2
        rec["note"] = "strings are ignored"
        rec["nan_metric/x"] = float("nan") if step == 3 else 1.0
        lines.append(json.dumps(rec))
    lines.append('{"step": 40, "reward/mean"')  # a run killed mid-write
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    evals = [
        {
            "step": s,
            "elapsed_s": 60.0 * s,
            "mean_avg_at_k": 0.2 + 0.01 * s,
            "k": 16,
            "benchmarks": {"a": 0.1 + 0.01 * s, "b": 0.3},
        }
        for s in (0, 10, 20, 30)
    ]
    (tmp_path / "eval_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


def test_one_png_per_group_with_titles(tmp_path):
    write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [
            "reward.png",
            "routing.png",
            "teacher.png",
            "dynamic_weight.png",
            "response_length.png",
            "time.png",
            "misc_custom.png",
            "misc_nan_metric.png",
            "eval_avg_at_k.png",
        ]
    )
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert p.parent == tmp_path / "plots"


def test_missing_log_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl does not exist"):
        plot_run(tmp_path)


def test_only_present_groups_are_drawn(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    assert [p.name for p in plot_run(tmp_path, tmp_path / "out")] == ["reward.png"]
