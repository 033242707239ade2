"""plot_run renders one readable PNG per metric group from metrics.jsonl, tolerating missing keys."""

from __future__ import annotations

import itertools
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


# End labels --------------------------------------------------------------------------------------------
def _gaps(positions):
    ys = sorted(positions)
    return [b - a for a, b in itertools.pairwise(ys)]


@pytest.mark.parametrize(
    "targets",
    [
        [0.0, 0.0],  # route/sdpo_frac on route/sdpo_loss_frac (same last value)
        [0.695, 0.695, 0.1],  # eval: the mean on its only benchmark
        [5.0, 5.5, 6.0, 30.0, 30.2],  # two clusters
        [3.0, 1.0, 2.0, 2.5],  # unsorted
        [10.0],
        [],
    ],
)
def test_spread_labels_keeps_every_two_at_least_the_gap_apart(targets):
    from srpo_megatron.evaluation.plots import spread_labels

    gap = 2.0
    placed = spread_labels(targets, gap)
    assert len(placed) == len(targets)
    assert all(g >= gap - 1e-9 for g in _gaps(placed)), placed
    # a cluster stays centred where its lines end (least-squares: the mean displacement is zero)
    assert abs(sum(placed) - sum(targets)) < 1e-9


def test_spread_labels_moves_nothing_that_is_already_apart_and_keeps_the_order():
    from srpo_megatron.evaluation.plots import spread_labels

    assert spread_labels([0.0, 10.0, 20.0], 2.0) == [0.0, 10.0, 20.0]
    placed = spread_labels([1.0, 1.0, 1.0], 1.0)
    assert placed == [0.0, 1.0, 2.0]  # equal targets: input order bottom to top
    with pytest.raises(ValueError, match="min_gap"):
        spread_labels([0.0], -1.0)


@pytest.mark.parametrize(
    "series",
    [
        # the demo's routing.png: sdpo_frac and sdpo_loss_frac end on the same value, fallback near them
        {
            "route/sdpo_frac": ([1, 12], [0.19, 0.0625]),
            "route/sdpo_loss_frac": ([1, 12], [0.19, 0.0625]),
            "route/fallback_frac": ([1, 12], [0.75, 0.375]),
            "route/grpo_frac": ([1, 12], [0.06, 0.5625]),
            "route/has_teacher_frac": ([1, 12], [0.19, 0.625]),
        },
        # the demo's eval_avg_at_k.png: one benchmark, so its line is the mean's
        {"arithmetic/level0": ([0, 12], [0.227, 0.695]), "mean": ([0, 12], [0.227, 0.695])},
    ],
)
def test_rendered_end_labels_do_not_overlap(series):
    import matplotlib.pyplot as plt

    from srpo_megatron.evaluation.plots import group_figure

    fig = group_figure(series, sorted(series), "t", "y", True)
    try:
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
        assert len(boxes) == len(series)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b), (a, b)
    finally:
        plt.close(fig)
