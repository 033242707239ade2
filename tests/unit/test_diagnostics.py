"""Diagnostics of issue 28: per-benchmark reward and accuracy on a mixed batch, and the "teacher moved?"
trend and inert-SDPO warning (``trainer/observe/teacher_watch.py``), each against a hand computation."""

from __future__ import annotations

import json

import pytest
import torch

from srpo_megatron.config import LossConfig, TeacherConfig
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.rollout.base import Completion
from srpo_megatron.trainer.collect.sample_routing import route_groups
from srpo_megatron.trainer.observe.metrics import MetricsLogger
from srpo_megatron.trainer.observe.teacher_watch import TeacherWatch, slope
from srpo_megatron.trainer.step_types import declared, merge_metrics, undeclared
from tests.helpers.sample_pool import CharTokenizer as _Tokenizer

# ------------------------------------------------------------------------------ per-benchmark rewards


def _batch(benchmarks: list[str], rewards: list[list[float]]):
    prompts = [
        Prompt((ord("q"), 48 + i), Row(f"question {i}", None, "-", "coin", b, f"f:{i}"))
        for i, b in enumerate(benchmarks)
    ]
    completions = [
        [Completion(i, [97 + j], [-0.5], "stop") for j in range(len(r))] for i, r in enumerate(rewards)
    ]
    texts = [[chr(97 + j) for j in range(len(r))] for r in rewards]
    return route_groups(_Tokenizer(), prompts, completions, texts, rewards, LossConfig(), TeacherConfig())


def test_per_benchmark_reward_and_accuracy_on_a_mixed_batch():
    rewards = [[1.0, 0.4, 0.0, 0.0], [1.0, 1.0, 0.6, 0.0], [0.0, 0.0, 0.0, 0.7]]
    m = _batch(["sciknoweval/physics", "sciknoweval/chemistry", "sciknoweval/physics"], rewards).metrics
    # physics = groups 0 and 2: rewards 1, .4, 0, 0, 0, 0, 0, .7; passing (>= 0.5): 1 and .7
    assert m["reward/sciknoweval/physics/mean"] == pytest.approx(2.1 / 8)
    assert m["reward/sciknoweval/physics/accuracy"] == pytest.approx(2 / 8)
    assert m["reward/sciknoweval/chemistry/mean"] == pytest.approx(2.6 / 4)
    assert m["reward/sciknoweval/chemistry/accuracy"] == pytest.approx(3 / 4)
    assert m["reward/mean"] == pytest.approx(4.7 / 12) and m["reward/accuracy"] == pytest.approx(5 / 12)
    assert not undeclared(m), "the per-benchmark names are declared (METRIC_FAMILIES)"


def test_a_one_benchmark_batch_logs_no_per_benchmark_metrics():
    m = _batch(["arithmetic", "arithmetic"], [[1.0, 0.0], [0.0, 0.0]]).metrics
    assert not [k for k in m if k.startswith("reward/arithmetic/")]


def test_benchmark_families_are_declared_but_not_every_name(tmp_path):
    assert declared("reward/a/b/mean").reduce == "mean"
    assert declared("reward/x/accuracy") is not None
    assert declared("reward//mean") is None and declared("reward/x/median") is None
    assert declared("reward/mean").doc.startswith("mean reward of the batch")  # the fixed name wins
    with pytest.raises(KeyError, match="not declared"):
        merge_metrics({"reward/x/median": 1.0})


# ------------------------------------------------------------------------------ teacher moved?


def test_slope_is_the_least_squares_slope():
    assert slope([1.0, 3.0]) == 2.0
    assert slope([5.0, 5.0, 5.0]) == 0.0
    ys = [0.9, 0.7, 0.72, 0.4, 0.35]
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    # the normal equation written the other way: Σxy − n·x̄·ȳ over Σx² − n·x̄²
    ref = (sum(i * y for i, y in enumerate(ys)) - n * mx * my) / (sum(i * i for i in range(n)) - n * mx * mx)
    assert slope(ys) == pytest.approx(ref, rel=1e-12)
    with pytest.raises(ValueError):
        slope([1.0])


def _step(div: float, sdpo: float = 0.3) -> dict[str, float]:
    return {"teacher/divergence_mean": div, "tokens/sdpo_frac": sdpo}


def test_trend_over_the_last_window_of_sdpo_steps():
    lines: list[str] = []
    w = TeacherWatch(lines.append, window=3)
    assert w.observe(1, _step(1.0)) == {}, "one point has no slope"
    assert w.observe(2, _step(0.0, sdpo=0.0)) == {}, "a step without SDPO tokens measures nothing"
    assert w.observe(3, _step(0.8)) == {"teacher/divergence_trend": pytest.approx(-0.2)}
    w.observe(4, _step(0.6))
    out = w.observe(5, _step(0.9))  # window 3: 0.8, 0.6, 0.9
    assert out["teacher/divergence_trend"] == pytest.approx(slope([0.8, 0.6, 0.9]))
    assert not lines


def test_inert_sdpo_warns_once_after_consecutive_steps_below_the_threshold():
    lines: list[str] = []
    w = TeacherWatch(lines.append, inert_below=1e-3, inert_steps=3)
    for step, div in enumerate([1e-4, 1e-4, 0.5, 1e-4, 1e-4], start=1):  # the 0.5 restarts the count
        w.observe(step, _step(div))
    w.observe(6, _step(0.0, sdpo=0.0))  # no SDPO tokens: neither counts nor breaks the run of steps
    assert not lines
    w.observe(7, _step(1e-4))
    assert len(lines) == 1 and "step 7" in lines[0] and "inert" in lines[0] and "\n" not in lines[0]
    for step in range(8, 12):
        w.observe(step, _step(1e-5))
    assert len(lines) == 1, "the warning is logged once"


def test_a_watch_restored_from_its_json_state_continues_like_the_uninterrupted_one():
    """A resume (the state through the checkpoint's JSON) logs the same trend and warns at the same step;
    a fresh watch in its place (the state not restored) gives no trend on the first step after the resume."""
    divs = [0.3, 1e-5, 1e-5, 0.2, 1e-5, 1e-5, 1e-5, 0.1]
    whole_lines: list[str] = []
    whole = TeacherWatch(whole_lines.append, window=4, inert_below=1e-4, inert_steps=3)
    expected = [whole.observe(i, _step(d)) for i, d in enumerate(divs, start=1)]
    lines: list[str] = []
    first = TeacherWatch(lines.append, window=4, inert_below=1e-4, inert_steps=3)
    got = [first.observe(i, _step(d)) for i, d in enumerate(divs[:5], start=1)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = TeacherWatch(lines.append, window=4, inert_below=1e-4, inert_steps=3, state=state)
    got += [resumed.observe(i, _step(d)) for i, d in enumerate(divs[5:], start=6)]
    assert got == expected and lines == whole_lines and len(lines) == 1
    fresh = TeacherWatch(print, window=4, inert_below=1e-4, inert_steps=3)
    assert fresh.observe(6, _step(divs[5])) == {} != expected[5]


def test_no_warning_while_the_teacher_teaches():
    lines: list[str] = []
    w = TeacherWatch(lines.append)
    for step in range(1, 30):
        w.observe(step, _step(0.05 + 0.01 * (step % 3)))
    assert not lines and not w.warned


def test_the_trend_is_a_declared_metric_the_logger_accepts(tmp_path):
    from srpo_megatron.config import RunConfig

    w = TeacherWatch(print)
    w.observe(1, _step(0.3))
    m = w.observe(2, _step(0.2))
    logger = MetricsLogger(tmp_path, RunConfig(tensorboard=False, progress_bar=False), total=2, start=0)
    logger.log(2, {**m, "reward/a/mean": 0.5})
    logger.close()
    assert '"teacher/divergence_trend"' in (tmp_path / "metrics.jsonl").read_text()
    assert torch.tensor(m["teacher/divergence_trend"]).item() == pytest.approx(-0.1)
