"""The study's analysis (examples/cpu_compare/study.py) on hand-made run files with known answers."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study", REPO / "examples" / "cpu_compare" / "study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(run: Path, evals: dict[int, list[list[float]]], entropy: list[float]) -> None:
    """evals: step -> per-problem lists of sample rewards."""
    for step, problems in evals.items():
        d = run / "eval" / f"step_{step:06d}" / "avg_at_k"
        d.mkdir(parents=True)
        lines = [
            json.dumps({"benchmark": "arithmetic/level4", "prompt_index": i, "sample_index": j, "reward": r})
            for i, rs in enumerate(problems)
            for j, r in enumerate(rs)
        ]
        (d / "samples.jsonl").write_text("\n".join(lines) + "\n")
        mean = sum(sum(rs) / len(rs) for rs in problems) / len(problems)
        with (run / "eval_log.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "elapsed_s": 0.0, "mean_avg_at_k": mean}) + "\n")
    with (run / "metrics.jsonl").open("w") as f:
        for s, h in enumerate(entropy, 1):
            f.write(json.dumps({"step": s, "teacher/entropy_mean": h, "time/step_s": 2.0}) + "\n")


def test_paired_differences_and_standard_errors_by_hand(study, tmp_path):
    # Two problems, k = 2. Seed s: SRPO final per-problem (1, a_s), GRPO final (0.5, 0); step 0 shared.
    a = {1: 1.0, 2: 0.5, 3: 0.0}
    for s in (1, 2, 3):
        base = [[0, 0], [0, 1]]
        _write_run(
            tmp_path / f"srpo_s{s}", {0: base, 2: [[1, 1], [0, 0]], 4: [[1, 1], [a[s], a[s]]]}, [1, 2, 3, 4]
        )
        _write_run(tmp_path / f"grpo_s{s}", {2: [[1, 0], [1, 1]], 4: [[1, 0], [0, 0]]}, [])
    runs = study.collect(tmp_path, ["srpo", "grpo"], [1, 2, 3], [1.0])
    summary = study.summarize(runs, ["srpo", "grpo"], [1, 2, 3], [1.0])
    # Final SRPO per seed: (1 + a_s)/2 = 1, 0.75, 0.5; GRPO 0.25 -> differences 0.75, 0.5, 0.25.
    final = next(p for p in summary["pairs"] if p["which"] == "final")
    assert final["per_seed"] == pytest.approx([0.75, 0.5, 0.25])
    assert final["diff"] == pytest.approx(0.5)
    assert final["se_seeds"] == pytest.approx(0.25 / math.sqrt(3))  # sd of (.75, .5, .25) is 0.25
    # Per-problem differences averaged over seeds: (0.5, 0.5) -> SE over problems 0.
    assert final["se_problems"] == pytest.approx(0.0)
    # Best (steps > 0): SRPO max(0.5, final) per seed = 1, 0.75, 0.5; GRPO max(0.75, 0.25) = 0.75.
    best = next(p for p in summary["pairs"] if p["which"] == "best")
    assert best["per_seed"] == pytest.approx([0.25, 0.0, -0.25])
    row = {r["mode"]: r for r in summary["table"]}
    assert row["grpo"]["step0"] == pytest.approx(0.25) == row["srpo"]["step0"]  # shared step-0 evaluation
    assert row["srpo"]["final"] == pytest.approx(0.75)
    claim = next(c for c in summary["claims"] if c["claim"].startswith("1a"))
    assert claim["value"] == pytest.approx(0.5) and claim["verdict"] == "supported"  # 0.5 > 2 × 0.144
    rise = next(c for c in summary["claims"] if c["claim"] == "4 teacher entropy rises (srpo)")
    assert rise["value"] == pytest.approx(3.0) and rise["verdict"] == "supported"  # last 4 − first 1, SE 0


def test_verdict_rule(study):
    assert study._verdict(0.1, 0.04, +1) == "supported"
    assert study._verdict(0.1, 0.06, +1).startswith("not supported")
    assert study._verdict(-0.1, 0.04, +1) == "contradicted"
    assert study._verdict(-0.1, 0.04, -1) == "supported"
    assert study._verdict(0.1, None, +1).startswith("undetermined")


def test_lr_ratios_are_the_papers(study):
    lr = 5e-6  # the paper's SRPO lr: GRPO 1e-6, SDPO 1e-5
    assert study.mode_lr("grpo", lr, 1.0) == pytest.approx(1e-6) and study.MINI_BATCHES["grpo"] == 4
    assert study.mode_lr("sdpo", lr, 1.0) == pytest.approx(1e-5)
    assert study.mode_lr("srpo_no_dw", lr, 2.0) == pytest.approx(1e-5)
