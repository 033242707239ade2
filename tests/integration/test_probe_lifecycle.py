"""Issue 30's probe, replayed on the run directory's life: two trainers on one ``run.dir``, a ``kill -9``
during a checkpoint write, a full disk (a 500 MB tmpfs), and a ``run.dir`` that cannot hold a run.

The real ``srpo train`` (tiny random Qwen3, CPU engine) in subprocesses, so exit status, stderr and the
process tree are what a user sees. The mid-write kill holds megatron's forked checkpoint writer in its
write (a test shim, ``_STUCK_WRITER``: a disk that never answers), so the kill lands there every time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from srpo_megatron import cli

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"

# `python stuck_writer.py MARK train ...`: srpo train whose checkpoint writer (megatron-core 0.16 forks it)
# writes its pid to MARK and then hangs, as on a disk that stopped answering.
_STUCK_WRITER = """
import os, sys, time

def _stuck(*args, **kwargs):
    with open(MARK, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(3600)

if __name__ == "__main__":
    MARK = sys.argv.pop(1)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.FileSystemWriterAsync.write_preloaded_data = staticmethod(_stuck)
    from srpo_megatron.cli import main

    sys.exit(main())
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=4)


def _argv(tiny, run_dir: Path | str, *overrides: str) -> list[str]:
    _, hf, data = tiny
    base = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}", "run.tensorboard=false"]
    return ["train", str(RECIPE), *(a for o in (*base, *overrides) for a in ("--override", o))]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}


def _srpo(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "srpo_megatron.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=timeout)


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def _wait_gone(pids: list[int], limit_s: float = 60.0) -> list[int]:
    """The pids still alive (not zombies) once they all ended or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def test_second_trainer_refused_kill9_mid_write_leaves_no_process_then_a_full_disk_stops_the_job(
    tiny, tmp_path
):
    """Issue 30, failures 5, 6 and 7, as the probe ran them, on one run directory on a 500 MB tmpfs:

    1. `srpo train` whose checkpoint writer hangs mid-write; a second `srpo train` on the same run.dir is
       refused in one line naming the first's host and pid;
    2. `kill -9` of the first: every process of its tree is gone (by pid), the lock with it;
    3. a new `srpo train` (2 steps) starts: its step-1 checkpoint (about 310 MB) fits, step 2's does not,
       and the save is refused in one line with the path and both sizes; the previous checkpoint stays;
    4. the requeued job is refused before torch loads: the save would fail the same way.

    Without a tmpfs (mount not allowed) step 3 trains on the plain disk and step 4 is left out."""
    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, "500m")
    run, mark = disk / "run", tmp_path / "writers"
    shim = tmp_path / "stuck_writer.py"
    shim.write_text(_STUCK_WRITER)
    first_log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(
        [sys.executable, str(shim), str(mark), *_argv(tiny, run, "train.steps=1")],
        stdout=first_log,
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=REPO,
    )
    tree: list[int] = []
    try:
        while not (mark.is_file() and mark.read_text().strip()) and first.poll() is None:
            time.sleep(0.2)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        writers = [int(p) for p in mark.read_text().split()]
        tree = [c.pid for c in psutil.Process(first.pid).children(recursive=True)]
        assert set(writers) <= set(tree), (writers, tree)  # forked by the trainer

        second = _srpo(_argv(tiny, run, "train.steps=1"))
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        assert _last_line(second) == (
            f"srpo train: error: run.dir={run} is in use by another trainer (host {socket.gethostname()} "
            f"pid {first.pid}, lock {run.resolve() / '.lock'}); stop that one, or pick another run.dir"
        )

        first.kill()  # kill -9, mid-write
        first.wait()
        left = _wait_gone(tree)
        assert not left, [" ".join(psutil.Process(p).cmdline()) for p in left if _alive(p)]

        third = _srpo(_argv(tiny, run, "train.steps=2"))  # gets the lock: it starts, and trains
        assert "Traceback" not in third.stderr, third.stderr[-3000:]
        assert f"removing {run / 'checkpoints' / 'step_000001.tmp'}" in third.stdout  # the killed save's
        if not mounted:
            assert third.returncode == 0, third.stderr[-3000:]
            return
        assert third.returncode == 2, third.stderr[-3000:]
        line = _last_line(third)
        previous = run / "checkpoints" / "step_000001"
        assert line.startswith(f"srpo train: error: not saving checkpoint step 2: {run / 'checkpoints'} has ")
        assert f"bytes free, the previous checkpoint {previous} takes " in line, line
        free, needed = (int(w) for w in line.split() if w.isdigit())
        assert free < needed
        assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001"  # the previous one stays

        requeued = _srpo(_argv(tiny, run, "train.steps=2"))
        assert requeued.returncode == 2 and "Traceback" not in requeued.stderr, requeued.stderr[-3000:]
        last = _last_line(requeued)
        assert last.startswith(f"srpo train: error: {run / '.save_failure.json'}: the save of step 2 failed")
        assert f"bytes free, {needed} needed; not starting again" in last, last  # free: less the record
        assert requeued.stdout == ""  # before torch, the data or the model
    finally:
        first.kill()
        first_log.close()
        _kill_all(tree)
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def _one_line(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("srpo train: error: "), err
    return err.strip()


def test_run_dir_that_cannot_hold_a_run_is_refused_before_the_model_loads(tiny, tmp_path, capsys):
    """Issue 30, point 12 and weak point `run.dir=`: each is one line with exit status 2, found before
    torch loads (the probe saw them after the model had loaded, or trained into the current directory)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    err = _one_line(capsys, _argv(tiny, a_file))
    assert f"run.dir={a_file} is a file, not a directory" in err

    err = _one_line(capsys, _argv(tiny, ""))
    assert "run.dir is empty: the run would write into the current directory" in err

    run = tmp_path / "run"
    (run / "checkpoints" / "latest").mkdir(parents=True)
    err = _one_line(capsys, _argv(tiny, run))
    assert f"{run / 'checkpoints' / 'latest'} is a directory" in err


def test_read_only_run_dir_is_refused_before_the_model_loads(tiny, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        if os.geteuid() == 0:
            pytest.skip("root writes through permission bits and cannot mount a read-only tmpfs here")
        ro.chmod(0o555)
    try:
        err = _one_line(capsys, _argv(tiny, ro))
        assert f"run.dir={ro} is not writable" in err
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(ro)], check=False)
        ro.chmod(0o755)
