"""tools/gpu_smoke.sh without a GPU: valid bash, one line saying it did not run, exit 0; its JSON assembly
(tools/gpu_smoke_checks.py) turns part outputs, timeouts and junit counts into the one final line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_smoke.sh"
CHECKS = REPO / "tools" / "gpu_smoke_checks.py"


@pytest.mark.parametrize("script", ["gpu_smoke.sh", "prepare_gpu_wheels.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(REPO / "tools" / script)], check=True)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and _cuda():
        pytest.skip("a GPU is visible: the script would run for real")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    line = json.loads(lines[0])
    assert line["gpu_smoke"] == "skipped" and "no CUDA GPU" in line["reason"]
    assert not (REPO / ".smoke").exists() or not any((REPO / ".smoke" / "parts").glob("*"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _checks(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(CHECKS), *args], capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout.strip()


def test_parts_combine_into_one_line_with_failures_and_timeouts(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    ok_log = tmp_path / "ok.log"
    ok_log.write_text('progress...\n{"tokens_per_s": 12.5, "mfu": 0.41}\n')
    (parts / "0.16.1__bench_mfu.json").write_text(_checks("wrap", str(ok_log), "0", "33"))
    slow_log = tmp_path / "slow.log"
    slow_log.write_text("step 1 of 3\n")
    (parts / "0.19.2__train_run.json").write_text(_checks("wrap", str(slow_log), "124", "75"))
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.unit.test_a" name="test_ok"/>'
        '<testcase classname="tests.unit.test_a" name="test_bad"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    tests_part = parts / "0.16.1__tests.json"
    tests_part.write_text(_checks("wrap", str(tmp_path / "absent.log"), "1", "90"))
    _checks("junit", str(junit), str(tests_part))
    line = _checks("combine", *sorted(str(p) for p in parts.glob("*.json")), "400")
    assert len(line.splitlines()) == 1
    out = json.loads(line)
    assert out["ok"] is False and out["seconds"] == 400
    assert out["0.16.1"]["bench_mfu"] == {
        "tokens_per_s": 12.5,
        "mfu": 0.41,
        "rc": 0,
        "seconds": 33,
        "timed_out": False,
        "ok": True,
    }
    assert out["0.19.2"]["train_run"]["timed_out"] is True and out["0.19.2"]["train_run"]["ok"] is False
    tests = out["0.16.1"]["tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (2, 1, 1)
    assert tests["failed_tests"] == ["tests.unit.test_a::test_bad"] and tests["ok"] is False
