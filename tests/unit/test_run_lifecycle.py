"""The run directory's life, unit by unit: metrics.jsonl repaired on resume (issue 30, failure 11), `srpo
plot` naming the lines it skips, the run-directory lock (failure 6), children that die with their parent
(failure 5) and the leftover-process check that ends `tools/dev test`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from srpo_megatron.evaluation.plots import _read_jsonl
from srpo_megatron.testing.leftovers import MARKER, leftovers
from srpo_megatron.trainer.observe.metrics import MetricsLogger
from srpo_megatron.trainer.run.run_dir import lock_run_dir, release_run_dir

REPO = Path(__file__).resolve().parents[2]
RUN = SimpleNamespace(tensorboard=False, wandb_project=None, progress_bar=False)


def _rows(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resumed_metrics_drop_rows_past_the_checkpoint_and_a_torn_last_line(tmp_path):
    """Steps 1-5 were logged, the checkpoint is step 3, the kill tore step 6's row: the resumed run's
    file reads 1, 2, 3, then its own 4 (the probe saw [1,2,3,1,2,3,4,...] and a swallowed row)."""
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(1, 6))
    path.write_text(rows + '{"step": 6, "rew')
    notes: list[str] = []
    logger = MetricsLogger(tmp_path, RUN, total=6, start=3, log=notes.append)
    logger.log(4, {"reward/mean": 0.25})
    logger.close()
    assert _rows(path) == [1, 2, 3, 4]
    assert notes == [
        f"{path}: dropped a torn last line (16 bytes), left by a run killed while writing it",
        f"{path}: dropped 2 row(s) of steps 4..5 (after step 3, the step this run resumes from); they are "
        "logged again as the steps rerun",
    ]


def test_metrics_of_a_clean_run_are_left_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')  # a whole last row without its newline is kept
    notes: list[str] = []
    MetricsLogger(tmp_path, RUN, total=3, start=2, log=notes.append).close()
    assert _rows(path) == [1, 2] and path.read_text().endswith("\n") and not notes


def test_plot_names_the_lines_it_skips(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "x\n{"step": 3}\n')
    assert [r["step"] for r in _read_jsonl(path)] == [1, 3]
    err = capsys.readouterr().err
    assert f"srpo plot: {path}: skipped 1 line(s) that are not a JSON row (line 2)" in err


_HOLD = (
    "import sys, time; from srpo_megatron.trainer.run.run_dir import lock_run_dir; "
    "lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(600)"
)


def test_run_dir_lock_names_its_holder_and_dies_with_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        problem = lock_run_dir(str(run))
        assert problem == (
            f"run.dir={run} is in use by another trainer (host {socket.gethostname()} pid {holder.pid}, lock "
            f"{run.resolve() / '.lock'}); stop that one, or pick another run.dir"
        )
    finally:
        holder.kill()  # kill -9: the kernel drops the lock
        holder.wait()
    assert lock_run_dir(str(run)) is None
    assert lock_run_dir(str(run)) is None  # this process holds it already: a second train() may run
    release_run_dir(str(run))


# A parent that forks (main thread) with the hook, then has a reward worker (spawned, from a scoring
# thread) call a reward that never returns; prints both pids and waits.
_PARENT = """
import os, sys, threading, time
from srpo_megatron.children import kill_forks_with_me
from srpo_megatron.rewards import register_reward
from srpo_megatron.rewards.pool import RewardPool

if __name__ == "__main__":
    kill_forks_with_me()
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    register_reward("hang", "hanging_reward:reward")
    pool = RewardPool(num_workers=1, timeout_s=600)
    threading.Thread(target=pool.score, args=(["hang"], ["x"], ["-"]), daemon=True).start()
    mark = os.environ["HANG_MARK"]
    while not (os.path.exists(mark) and open(mark).read().strip()):
        time.sleep(0.05)
    print(pid, open(mark).read().strip(), flush=True)
    time.sleep(600)
"""
_HANGING = """
import os, time

def reward(response, answer):
    with open(os.environ["HANG_MARK"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return 1.0
"""


def test_forked_and_spawned_children_die_with_a_killed_parent(tmp_path):
    """The fork (megatron 0.16's checkpoint writer forks like this) and a reward worker busy in a reward
    that never returns: both end once their parent is killed with SIGKILL."""
    script, mods = tmp_path / "parent.py", tmp_path / "mods"
    script.write_text(_PARENT)
    mods.mkdir()
    (mods / "hanging_reward.py").write_text(_HANGING)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{mods}", "HANG_MARK": str(tmp_path / "hang")}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    children = [int(p) for p in parent.stdout.readline().split()]
    try:
        assert len(children) == 2 and all(psutil.pid_exists(p) for p in children), children
        parent.kill()  # kill -9
        parent.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)]
    finally:
        for p in children:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_leftover_check_finds_a_process_of_the_test_run_and_no_other(tmp_path):
    run_id = f"unit-{os.getpid()}"
    env = {**os.environ, MARKER: run_id}
    orphan = subprocess.Popen(["sleep", "600"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "600"], env={**os.environ, MARKER: "another-run"})
    try:
        found = leftovers(run_id)
        assert list(found) == [orphan.pid] and "sleep 600" in found[orphan.pid], found
        done = subprocess.run(
            [sys.executable, "-m", "srpo_megatron.testing.leftovers", run_id],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "SRPO_LEFTOVER_GRACE_S": "0"},
        )
        assert done.returncode == 1 and f"pid {orphan.pid}" in done.stderr and "sleep 600" in done.stderr
        assert orphan.wait(timeout=30) == -signal.SIGKILL  # killed, not left for an hour
        assert other.poll() is None
    finally:
        for p in (orphan, other):
            p.kill()
            p.wait()
