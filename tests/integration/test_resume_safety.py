"""`srpo train` on a damaged run directory: it resumes from the newest complete checkpoint and says so,
and a resumed run with a changed recipe applies what may change and refuses the rest.

The real trainer (tiny random Qwen3, CPU engine, ``srpo_megatron.testing.tiny:coin_reward``) through the
real CLI in a subprocess, so exit status and stderr are what a user sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=8)


def _train(tiny, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    _, hf, data = tiny
    base = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}", "run.tensorboard=false"]
    argv = [a for o in (*base, *overrides) for a in ("--override", o)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "srpo_megatron.cli", "train", str(RECIPE), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lost_latest_and_corrupted_newest_resume_from_newest_complete(tiny, tmp_path):
    run = tmp_path / "run"
    first = _train(tiny, run, "train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000002"
    assert (root / "step_000002" / "manifest.json").is_file()

    # The newest checkpoint's largest shard loses a byte in the middle (same size), `latest` is deleted,
    # and an interrupted save left its temporary behind.
    (root / "latest").unlink()
    shard = max(
        (p for p in (root / "step_000002").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (root / "step_000003.tmp").mkdir()

    second = _train(tiny, run, "train.steps=3")
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout
    assert f"resuming from {root / 'step_000001'}, the newest checkpoint that verifies" in out, out
    assert f"skipped: {shard} does not match its SHA-256" in out, out
    assert f"removing {root / 'step_000003.tmp'}" in out
    assert "resume: applying recipe change train.steps: 2 -> 3" in out
    assert "data: train: 8 prompts from 8 rows, 0 bad rows skipped" in out
    assert f"{run / 'metrics.jsonl'}: dropped 1 row(s) of steps 2..2 (after step 1" in out
    assert _steps(run) == [1, 2, 3]  # continued after step 1, not from scratch; step 2's first row dropped
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 3  # what is in force

    third = _train(tiny, run, "train.steps=3", "optim.lr=0.5")
    assert third.returncode == 2
    last = third.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("srpo train: error: resuming from") and "optim.lr: 0.001 -> 0.5 cannot change" in last
    )
    assert "Traceback" not in third.stderr
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 0.001  # not rewritten
