"""The metric gate's comparison and report (``srpo_megatron.testing.gate``) on hand-made histories: a value
outside its band is reported with its metric, step, value and band, and drawn against the band; values in
band pass; metrics outside the gated list are ignored; a gated metric the run did not log fails."""

from __future__ import annotations

import json

import pytest

from srpo_megatron.testing import gate

TOL = {"loss/sdpo": {"abs": 1e-6, "rel": 1e-3}, "route/sdpo_frac": {"abs": 1e-9, "rel": 0.0}}
HISTORY = {"loss/sdpo": {"1": 0.5, "2": 0.25}, "route/sdpo_frac": {"1": 0.5, "2": 0.375}}


def _run(changes=None):
    run = {k: {int(s): v for s, v in steps.items()} for k, steps in HISTORY.items()}
    run["diag/new_metric"] = {1: 123.0, 2: -4.0}  # a key added after the history was written
    for (metric, step), value in (changes or {}).items():
        run[metric][step] = value
    return run


def test_values_inside_their_bands_pass_and_new_metric_keys_are_ignored():
    moved, compared = gate.compare(_run({("loss/sdpo", 2): 0.25 * (1 + 9e-4)}), HISTORY, TOL)
    assert moved == []
    assert {m.metric for m in compared} == set(TOL)


def test_a_value_outside_its_band_is_named_with_step_value_and_band(tmp_path):
    run = _run({("loss/sdpo", 2): 0.2503, ("route/sdpo_frac", 1): 0.5 + 1 / 24})
    moved, _ = gate.compare(run, HISTORY, TOL)
    assert [(m.metric, m.step) for m in moved] == [("loss/sdpo", 2), ("route/sdpo_frac", 1)]
    assert moved[0].band == pytest.approx((0.25 - 0.000251, 0.25 + 0.000251))
    text = gate.table(moved)
    assert "loss/sdpo" in text and "0.2503" in text and "0.249749" in text and "0.250251" in text
    assert "route/sdpo_frac" in text and "0.5416667" in text
    pngs = gate.plot_moved(moved, run, HISTORY, TOL, tmp_path)
    assert sorted(p.name for p in pngs) == ["loss__sdpo.png", "route__sdpo_frac.png"]
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_a_gated_metric_missing_from_the_run_fails():
    run = _run()
    del run["route/sdpo_frac"][2]
    moved, _ = gate.compare(run, HISTORY, TOL)
    assert [(m.metric, m.step, m.value) for m in moved] == [("route/sdpo_frac", 2, None)]
    assert "missing" in gate.table(moved)


def test_the_repository_history_covers_every_gated_metric_at_every_step():
    tol = gate.load_tolerances()
    history = json.loads(gate.HISTORY.read_text())["metrics"]
    assert set(history) == set(tol), "tools/dev gate --update rewrites the history for the gated list"
    steps = {len(v) for k, v in history.items() if not k.startswith("eval/")}
    assert len(steps) == 1, "every train metric has one value per gated step"
    for key in (
        "reward/mean",
        "route/grpo_frac",
        "route/sdpo_frac",
        "loss/grpo",
        "loss/sdpo",
        "teacher/entropy_mean",
        "dw/w_tilde_mean",
        "dw/w_tilde_std",
        "grad_norm",
        "logprob/gap_mean",
    ):
        assert key in tol, f"{key} must be gated (issue 28)"
    assert any(k.startswith("eval/") for k in tol), "held-out accuracy must be gated"
    both = [
        s
        for s in history["route/grpo_frac"]
        if history["route/grpo_frac"][s] > 0 and history["route/sdpo_frac"][s] > 0
    ]
    assert len(both) >= len(history["route/sdpo_frac"]) - 1, "the run must route to both branches"
