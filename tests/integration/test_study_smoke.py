"""The study command end to end on a tiny random model: 2 steps, 1 seed, two modes (one a Fig. 1(b) mode).

It checks that ``examples/cpu_compare/study.py`` trains each run through ``srpo train``, writes the
results table (markdown + JSON) and the curves, resumes without retraining, and that its numbers are the
run files' numbers. The tiny model and its coin-flip reward say nothing about the method.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "examples" / "cpu_compare" / "study.py"
ARGS = [
    "--smoke",
    "--seeds",
    "1",
    "--steps",
    "2",
    "--eval-every",
    "2",
    "--eval-problems",
    "3",
    "--eval-k",
    "2",
]
MODES = ["sdpo", "sdpo_correct_only"]
# Measured on the loaded machine: ~315 CPU s for the module (2 tiny runs + a rerun), over the ~60 s aim;
# the wall-clock limit only has to survive a heavily shared machine (30 min at load ~40).
pytestmark = pytest.mark.timeout(2400)


def _study(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(STUDY), "--out", str(out), *ARGS, "--modes", *MODES, *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2400)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    res = _study(out)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def test_study_writes_table_json_and_plots(study):
    out, _ = study
    results = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in results["table"]] == MODES
    assert all(r["seeds"] == 1 and r["final"] is not None for r in results["table"])
    pair = next(
        p for p in results["pairs"] if (p["a"], p["b"], p["which"]) == ("sdpo_correct_only", "sdpo", "final")
    )
    assert pair["seeds"] == 1 and pair["se_seeds"] is None  # one seed: no SE over seeds
    md = (out / "results.md").read_text()
    assert "| sdpo_correct_only | sdpo | 1 | final |" in md and "## Claims" in md
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # The correct-only run trained only correct samples that have another correct sibling.
    rows = [json.loads(x) for x in (out / "sdpo_correct_only_s1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["route/sdpo_loss_frac"] <= r["reward/accuracy"] + 1e-9 for r in rows)
    assert all(r["loss/grpo"] == 0.0 for r in rows)


def test_table_numbers_are_the_run_files_numbers(study):
    out, _ = study
    results = json.loads((out / "results.json").read_text())
    for row in results["table"]:
        run = out / f"{row['mode']}_s1"
        log = {
            json.loads(x)["step"]: json.loads(x) for x in (run / "eval_log.jsonl").read_text().splitlines()
        }
        assert row["final"] == pytest.approx(log[2]["mean_avg_at_k"], abs=1e-12)
    # Step 0 is evaluated once per seed (first mode) and shared.
    assert 0 in {json.loads(x)["step"] for x in (out / "sdpo_s1" / "eval_log.jsonl").read_text().splitlines()}
    assert 0 not in {
        json.loads(x)["step"]
        for x in (out / "sdpo_correct_only_s1" / "eval_log.jsonl").read_text().splitlines()
    }
    assert all(r["step0"] == results["table"][0]["step0"] for r in results["table"])


def test_rerun_resumes_without_training(study):
    out, _ = study
    res = _study(out)
    assert res.returncode == 0 and " train " not in res.stdout  # every run was complete: no srpo train
