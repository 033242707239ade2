"""tools/bench_off_policy.py's arithmetic (step times, idle shares, the JSON line) from given metrics rows,
and ``testing/standin_process.StandInProcess``: it serves, and leaves no process behind (stopped, failed
start, parent killed)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from srpo_megatron.testing.standin_process import StandInProcess, StandInStartError

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_off_policy", REPO / "tools" / "bench_off_policy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(step_s, generate_s, score_s=0.5, teacher_s=0.25, train_s=1.0, sync_s=0.25, **extra):
    return {
        "time/step_s": step_s,
        "time/generate_s": generate_s,
        "time/score_s": score_s,
        "time/teacher_s": teacher_s,
        "time/train_s": train_s,
        "time/weight_sync_s": sync_s,
        **extra,
    }


def test_summary_skips_the_first_step_and_computes_idle_from_the_phases():
    bench = _bench()
    # first step: warm-up figures that must not count; then trainer busy 2 s, generate 2 s per step
    rows = [_row(50.0, 30.0, train_s=20.0), _row(4.0, 2.0), _row(4.0, 2.0), _row(5.0, 2.0)]
    arrivals = [100.0, 110.0, 113.0, 116.5]  # gaps 10, 3, 3.5: steps 2..4
    s = bench.run_summary(rows, arrivals)
    assert s["steps"] == 4
    assert s["step_s_wall"] == 3.5 and s["step_s_metric"] == 4.0
    assert s["generate_s"] == 2.0 and s["trainer_busy_s"] == 2.0 and s["train_s"] == 1.0
    assert s["idle_from"] == "phases"
    # ratios of sums over steps 2..4: 13 step-seconds, 6 busy each
    assert s["engine_idle_share"] == pytest.approx(1 - 6 / 13)
    assert s["trainer_idle_share"] == pytest.approx(1 - 6 / 13)
    assert s["idle_share"] == pytest.approx(1 - 6 / 13)
    assert bench.step_s(s) == 3.5


def test_summary_prefers_the_logged_idle_shares():
    bench = _bench()
    idle = {"async/engine_idle_share": 0.9, "async/trainer_idle_share": 0.9}
    rows = [
        _row(9.0, 1.0, **idle),
        _row(4.0, 2.0, **{"async/engine_idle_share": 0.2, "async/trainer_idle_share": 0.0}),
        _row(4.0, 2.0, **{"async/engine_idle_share": 0.1, "async/trainer_idle_share": 0.1}),
    ]
    s = bench.run_summary(rows, [0.0, 4.0, 8.0])
    assert s["idle_from"] == "metrics"
    assert s["engine_idle_share"] == pytest.approx(0.15) and s["trainer_idle_share"] == pytest.approx(0.05)
    assert s["idle_share"] == pytest.approx(0.1)
    # a run that logged them only on some steps falls back to the phase times
    del rows[2]["async/trainer_idle_share"]
    assert bench.run_summary(rows, [0.0, 4.0, 8.0])["idle_from"] == "phases"


def test_one_step_run_uses_time_step_s():
    bench = _bench()
    s = bench.run_summary([_row(6.0, 3.0)], [1.0])
    assert s["step_s_wall"] is None and bench.step_s(s) == 6.0


def test_pairs_combine_to_medians_and_the_median_pair_ratio():
    bench = _bench()
    assert [bench.pair_order(i) for i in range(3)] == [(0, 1), (1, 0), (0, 1)]

    def summary(step, gen):
        return bench.run_summary([_row(step, gen)] * 3, [0.0, step, 2 * step])

    # the machine slows down between pairs: each pair's own ratio is what counts
    pairs = [{0: summary(4.0, 2.0), 1: summary(2.4, 2.0)}, {0: summary(8.0, 4.0), 1: summary(4.0, 4.0)}]
    n0, n1, ratio = bench.combine(pairs)
    assert n0["step_s_wall"] == 6.0 and n1["step_s_wall"] == pytest.approx(3.2)
    assert n0["generate_s"] == 3.0 and n0["idle_from"] == "phases"
    assert ratio == pytest.approx((0.6 + 0.5) / 2)


def test_result_line_is_one_json_object_with_the_figures():
    bench = _bench()
    n0 = bench.run_summary([_row(5.0, 2.0)] * 3, [0.0, 5.0, 10.0])  # generate 2, trainer 2, 1 s other
    n1 = bench.run_summary([_row(3.0, 2.0)] * 3, [0.0, 3.0, 6.0])
    line = bench.result_line(n0, n1, 0.6, {"load_avg_before": 1.5})
    assert "\n" not in line
    out = json.loads(line)
    assert out["step_s_n0"] == 5.0 and out["step_s_n1"] == 3.0 and out["ratio_n1_vs_n0"] == 0.6
    assert out["ideal_ratio"] == pytest.approx(3.0 / 5.0)  # 1 s serial + max(2, 2)
    assert out["idle_share_n0"] == pytest.approx(0.6) and out["idle_share_n1"] == pytest.approx(
        1 / 3, abs=1e-4
    )
    assert out["generate_s_n0"] == 2.0 and out["trainer_busy_s_n1"] == 2.0 and out["load_avg_before"] == 1.5


# ------------------------------------------------------------------------------------ standin_process


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_qwen3_no_tokenizer

    return write_tiny_qwen3_no_tokenizer(tmp_path_factory.mktemp("standin_model"))


def test_standin_process_serves_with_one_thread_and_leaves_nothing_behind(model_dir):
    server = StandInProcess(model_dir)
    try:
        assert server.pid != os.getpid() and _alive(server.pid)
        info = json.loads(urllib.request.urlopen(server.url + "/get_server_info", timeout=30).read())
        assert info["tp_size"] == 1
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in environ
        assert os.getpgid(server.pid) == server.pid, "the child leads a process group of its own"
    finally:
        server.stop()
    assert not _alive(server.pid), "the stand-in server process outlived stop()"
    assert not _group_alive(server.pid), "a process of the stand-in's group outlived stop()"
    server.stop()  # idempotent


def _pid_in(error: Exception) -> int:
    return int(str(error).split("(pid ")[1].split(")")[0])


def test_failed_start_names_the_cause_and_leaves_nothing_behind(tmp_path, model_dir):
    with pytest.raises(StandInStartError, match="exited with status") as err:
        StandInProcess(tmp_path / "no_model_here")
    assert "no_model_here" in str(err.value), "the child's log tail names what failed"
    assert not _alive(_pid_in(err.value))
    # a child still starting when the timeout passes is killed, with its whole group
    with pytest.raises(StandInStartError, match="did not serve within") as err:
        StandInProcess(model_dir, startup_timeout_s=0.01)
    assert not _alive(_pid_in(err.value)) and not _group_alive(_pid_in(err.value))


_ORPHANING_PARENT = """
import os, signal, sys
from srpo_megatron.testing.standin_process import StandInProcess
server = StandInProcess(sys.argv[1])
print(server.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no stop(), no atexit
"""


def test_child_exits_when_its_parent_is_killed(model_dir):
    parent = subprocess.run(
        [sys.executable, "-c", _ORPHANING_PARENT, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert parent.returncode == -signal.SIGKILL, parent.stderr[-2000:]
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 60  # a hang guard, not a speed check: the child exits at once
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.killpg(pid, signal.SIGKILL)
    assert not alive, "the stand-in server outlived the process that started it"
