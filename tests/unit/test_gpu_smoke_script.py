"""tools/gpu_smoke.sh without a GPU: valid bash, one line saying it did not run, exit 0 (ACCEPTANCE=1: the
doctor's acceptance check, its summary line); its plan (part order,
caps within the 8 minutes, the GPU test subset) and its JSON assembly (tools/gpu_smoke_checks.py: part
outputs, timeouts, junit counts or the -v log of a stopped pytest, the summary); the test harness's backend
(NCCL for CUDA ranks that each have a GPU, gloo otherwise)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_smoke.sh"
CHECKS = REPO / "tools" / "gpu_smoke_checks.py"

_spec = importlib.util.spec_from_file_location("gpu_smoke_checks", CHECKS)
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)

EVERY_PART = {
    "install",
    "tests",
    "train_run",
    "train",
    "compile",
    "bench_losses",
    "bench_fused_output",
    "bench_mfu",
}
ONCE = {"compile", "bench_losses", "bench_fused_output", "bench_mfu"}  # the first version of a call only


@pytest.mark.parametrize("script", ["gpu_smoke.sh", "prepare_gpu_wheels.sh"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(REPO / "tools" / script)], check=True)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and _cuda():
        pytest.skip("a GPU is visible: the script would run for real")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("SMOKE_REHEARSE", None)
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    line = json.loads(lines[0])
    assert line["gpu_smoke"] == "skipped" and "no CUDA GPU" in line["reason"]
    parts = REPO / ".cache" / "smoke" / "parts"
    assert not parts.exists() or not any(parts.glob("*"))


def test_acceptance_mode_runs_the_doctors_acceptance_and_ends_with_its_summary(tmp_path):
    """ACCEPTANCE=1 (inside the image) hands over to `srpo doctor --acceptance --json`: its check lines in
    SMOKE_DIR/acceptance.jsonl, its summary as the one line, its exit status (here: a CPU run, rc 0)."""
    if _cuda():
        pytest.skip("a GPU is visible: the acceptance would run for real")
    env = dict(os.environ, PYTHON=sys.executable, ACCEPTANCE="1", SMOKE_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["passed"] is True, proc.stdout
    checks = (tmp_path / "acceptance.jsonl").read_text().splitlines()
    assert len(checks) > 10 and all(json.loads(c)["status"] in ("ok", "skipped") for c in checks[:-1])


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _checks(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(CHECKS), *args], capture_output=True, text=True, check=True, timeout=300
    )
    return out.stdout.strip()


# ------------------------------------------------------------------------------------------------ the plan


def test_the_container_version_runs_first_and_every_part_fits_the_8_minutes():
    container = smoke.container_mcore()  # cluster/container/versions.env: the GPU image's megatron-core
    other = "0.16.1" if container != "0.16.1" else "0.19.2"
    run, not_run = smoke.plan([other, container], smoke.BUDGET_S)
    versions = [v for v, _, _ in run if v != "setup"]
    assert versions and set(versions) == {container}, "the container's version must get its turn first"
    assert run[0][:2] == ("setup", "deps")
    assert {name for v, name, _ in run if v == container} == EVERY_PART
    total = sum(cap for _, _, cap in run)
    assert total <= smoke.BUDGET_S < smoke.DEADLINE_S == 480, (total, smoke.BUDGET_S)
    # The other does not fit whole: none of its parts starts, each says how to run it in a call of its own.
    assert {name for v, name, _ in not_run if v == other} == EVERY_PART - ONCE
    assert all(f"MCORE_VERSIONS={other}" in reason for _, _, reason in not_run)
    # One version per call: it gets the whole plan, the benches too.
    alone, none_left = smoke.plan([other], smoke.BUDGET_S)
    assert not none_left and {name for v, name, _ in alone if v == other} == EVERY_PART


def test_a_version_that_does_not_fit_whole_does_not_start():
    run, not_run = smoke.plan(["0.19.2"], 100)
    assert sum(cap for _, _, cap in run) <= 100
    assert [name for _, name, _ in run] == ["deps"]
    assert {name for _, name, _ in not_run} == EVERY_PART


def test_gpu_tests_are_collected_and_need_neither_nemo_run_nor_slurm_nor_strict_device(mcore_version):
    ids = smoke.gpu_test_ids(mcore_version)
    files = {i.split("::")[0] for i in ids}
    for f in files:  # nemo-run and Slurm are not carried to the GPU machine
        text = (REPO / f).read_text()
        assert "nemo_run" not in text and "slurm" not in text, f"{f} needs nemo-run or Slurm"
        assert "strict_device" not in text, f"{f}: the strict-device mode is a CPU emulation of CUDA"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    collected = [x for x in proc.stdout.splitlines() if "::" in x]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for i in ids:  # a renamed test or parameter must not silently shrink the subset
        assert any(c == i or c.startswith((f"{i}[", f"{i}::")) for c in collected), f"{i} is not collected"


def test_a_launch_test_in_the_subset_is_refused(monkeypatch, mcore_version):
    monkeypatch.setattr(smoke, "GPU_TESTS", (*smoke.GPU_TESTS, ("tests/unit/test_launch.py", None)))
    with pytest.raises(AssertionError, match="needs nemo-run"):
        test_gpu_tests_are_collected_and_need_neither_nemo_run_nor_slurm_nor_strict_device(mcore_version)


def test_the_script_records_every_part_even_when_the_budget_stops_them(tmp_path):
    """The real script, rehearsal mode, a 30 s budget: the deps part runs (nothing is missing here), the
    rest is recorded as not run; the one line carries every part, its seconds and the summary keys."""
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        SMOKE_REHEARSE="1",
        SMOKE_BUDGET_S="30",
        SMOKE_DIR=str(tmp_path / "smoke"),
        MCORE_VERSIONS="0.16.1 0.19.2",
    )
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    assert out["gpu_smoke"] == "rehearsal" and out["budget_s"] == 30
    assert out["setup"]["deps"]["ok"] is True and out["setup"]["deps"]["cap_s"] == 25
    assert "setup/deps" in out["part_seconds"]
    assert set(out["0.19.2"]) == EVERY_PART and set(out["0.16.1"]) == EVERY_PART - ONCE
    assert all(p["ok"] is None and "not run" in p["not_run"] for p in out["0.19.2"].values())
    assert out["ok"] is True  # parts left out by the plan are not failures
    assert set(out["summary"]["0.19.2"]) == {
        "tests",
        "train",
        "compile",
        "bench_losses",
        "bench_fused_output",
        "bench_mfu",
    }


# -------------------------------------------------------------------------------------- the JSON assembly


def test_parts_combine_into_one_line_with_failures_timeouts_and_a_summary(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    ok_log = tmp_path / "ok.log"
    mfu = {"recompute_none": {"tokens_per_s": 12.5, "mfu": 0.41}, "recompute_full": {"mfu": 0.33}}
    ok_log.write_text("progress...\n" + json.dumps(mfu) + "\n")
    (parts / "0.19.2__bench_mfu.json").write_text(_checks("wrap", str(ok_log), "0", "33", "120"))
    _checks("annotate", str(parts / "0.19.2__bench_mfu.json"), "torch_compile=false")
    slow_log = tmp_path / "slow.log"
    slow_log.write_text("step 1 of 3\n")
    (parts / "0.19.2__train_run.json").write_text(_checks("wrap", str(slow_log), "130", "75", "75"))
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.unit.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.unit.test_a" name="test_bad" time="7.25">'
        '<failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    tests_part = parts / "0.19.2__tests.json"
    tests_part.write_text(_checks("wrap", str(tmp_path / "absent.log"), "1", "90", "140"))
    _checks("junit", str(junit), str(tests_part))
    (parts / "0.16.1__tests.json").write_text(json.dumps({"ok": None, "not_run": "not run: over budget"}))
    line = _checks("combine", "rehearsal", "460", "400", *sorted(str(p) for p in parts.glob("*.json")))
    assert len(line.splitlines()) == 1
    out = json.loads(line)
    assert out["ok"] is False and out["seconds"] == 400 and out["gpu_smoke"] == "rehearsal"
    assert out["0.19.2"]["bench_mfu"] == {
        **mfu,
        "rc": 0,
        "seconds": 33,
        "cap_s": 120,
        "timed_out": False,
        "ok": True,
        "torch_compile": False,
    }
    assert out["0.19.2"]["train_run"]["timed_out"] is True and out["0.19.2"]["train_run"]["ok"] is False
    tests = out["0.19.2"]["tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (2, 1, 1)
    assert tests["failed_tests"] == ["tests.unit.test_a::test_bad"] and tests["ok"] is False
    assert tests["slowest_s"] == [["test_bad", 7.2], ["test_ok", 1.5]]
    summary = out["summary"]["0.19.2"]
    assert summary["tests"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert summary["bench_mfu"]["mfu_none"] == 0.41 and summary["bench_mfu"]["mfu_full"] == 0.33
    assert summary["bench_mfu"]["torch_compile"] is False
    assert out["part_seconds"]["0.19.2/tests"] == 90 and out["part_seconds"]["0.16.1/tests"] is None


def test_a_stopped_pytest_is_counted_from_its_verbose_log(tmp_path):
    """The tests part stops pytest at its cap (SIGINT): the counts of what finished must survive."""
    log = tmp_path / "tests.log"
    log.write_text(
        "tests/dist/test_a.py::test_x[mcore-0.19.2] PASSED                     [ 10%]\n"
        "tests/dist/test_a.py::test_y[mcore-0.19.2] FAILED                     [ 20%]\n"
        "tests/dist/test_b.py::test_z[mcore-0.19.2-ema] SKIPPED (needs 2 ranks) [ 30%]\n"
        "tests/dist/test_b.py::test_w[mcore-0.19.2] PASSED                     [ 40%]\n"
        "tests/dist/test_b.py::test_w[mcore-0.19.2] ERROR                      [ 40%]\n"
        "FAILED tests/dist/test_a.py::test_y[mcore-0.19.2] - AssertionError\n"
        "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n"
    )
    part = tmp_path / "tests.json"
    part.write_text(_checks("wrap", str(log), "130", "140", "140"))
    _checks("junit", str(tmp_path / "absent.xml"), str(part), str(log))
    got = json.loads(part.read_text())
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 2, 1)
    assert got["failed_tests"] == [
        "tests/dist/test_a.py::test_y[mcore-0.19.2]",
        "tests/dist/test_b.py::test_w[mcore-0.19.2]",
    ]
    assert got["timed_out"] is True and got["ok"] is False and "counted_from" in got


def test_the_compile_check_runs_megatrons_fused_swiglu_and_says_whether_it_compiled():
    env = dict(os.environ, TORCH_COMPILE_DISABLE="1")  # the rehearsal's stub: eager, seconds not minutes
    proc = subprocess.run(
        [sys.executable, str(CHECKS), "compile-check"], capture_output=True, text=True, env=env, timeout=300
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ok"] is True and got["compiled"] is False and got["max_abs_diff"] == 0.0, got


# --------------------------------------------------------------------------------- the harness's backend


def test_harness_uses_nccl_when_every_rank_has_a_gpu_and_gloo_otherwise():
    from srpo_megatron.testing.distributed import harness_backend

    assert harness_backend(1, 0) == "gloo"  # CPU machine
    assert harness_backend(1, 1) == "cpu:gloo,cuda:nccl"  # the one-GPU smoke: CUDA tensors over NCCL
    assert harness_backend(8, 8) == "cpu:gloo,cuda:nccl"
    assert harness_backend(2, 1) == "gloo"  # NCCL refuses two ranks on one GPU


def _backend(rank, world):
    import torch.distributed as dist

    return dist.get_backend()


def test_harness_backend_on_this_machine():
    from srpo_megatron.testing.distributed import harness_backend, run_distributed

    want = harness_backend(1, _cuda_count())
    [got] = run_distributed(_backend, 1, timeout=300)
    assert got in (want, "nccl"), (got, want)  # torch names a cpu:gloo,cuda:nccl group either way


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_the_fused_output_bench_line_is_skipped_without_cuda_and_summarised_with_it():
    """The GPU script's fused-output part: on this CPU its ``--cuda`` mode says ``skipped: needs CUDA`` and
    exits 0; on a GPU its figures (the bf16 weight-gradient GEMM against the fp32 one and megatron's output
    layer) reach the summary."""
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench_fused_output.py"), "--cuda", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert "skipped: needs CUDA" in lines[0] and json.loads(lines[-1]) == {"skipped": "needs CUDA"}
    part = {"wgrad_mode": "apex", "fused_bf16_vs_fp32_wgrad_time": 0.6, "fused_bf16_vs_megatron_time": 1.1}
    got = smoke.summary({"0.19.2": {"bench_fused_output": part}})["0.19.2"]["bench_fused_output"]
    assert got["wgrad_mode"] == "apex" and got["fused_bf16_vs_fp32_wgrad_time"] == 0.6
