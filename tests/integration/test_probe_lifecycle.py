"""Issue 30's probe, replayed on the run directory's life: two trainers on one ``run.dir``, a ``kill -9``
during a checkpoint write, a full disk, and a ``run.dir`` that cannot hold a run.

The real ``srpo train`` (tiny random Qwen3, CPU engine) in subprocesses, so exit status, stderr and the
process tree are what a user sees. The mid-write kill holds megatron's forked checkpoint writer in its
write (a test shim, ``_STUCK_WRITER``: a disk that never answers), so the kill lands there every time.
"""

from __future__ import annotations

import contextlib
import json
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
from srpo_megatron.trainer.run_dir import check_run_dir_early, release_run_dir

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


def test_second_trainer_refused_kill9_mid_write_leaves_no_process_and_frees_the_lock(tiny, tmp_path):
    """Issue 30, failures 5 and 6: `srpo train` twice on one run.dir, then `kill -9` of the first while its
    checkpoint writer is writing, then a third `srpo train`."""
    run, mark = tmp_path / "run", tmp_path / "writers"
    shim = tmp_path / "stuck_writer.py"
    shim.write_text(_STUCK_WRITER)
    first = subprocess.Popen(
        [sys.executable, str(shim), str(mark), *_argv(tiny, run, "train.steps=1")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=REPO,
    )
    tree: list[int] = []
    try:
        while not (mark.is_file() and mark.read_text().strip()) and first.poll() is None:
            time.sleep(0.2)
        assert first.poll() is None, first.stderr.read()[-3000:] if first.stderr else ""
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

        # a new `srpo train` gets the lock: the same check its CLI makes before torch loads, in-process
        check_run_dir_early(str(run))
        assert (run / ".lock").read_text() == f"host {socket.gethostname()} pid {os.getpid()}\n"
        release_run_dir(str(run))
    finally:
        first.kill()
        _kill_all(tree)


@pytest.fixture
def small_disk(tmp_path):
    """A 200 MB tmpfs (the tiny run's checkpoint takes about 310 MB); skipped where mount is not allowed."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the unit tests cover it")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_save_is_one_line_naming_the_path_and_is_recorded(tiny, small_disk):
    """Issue 30, failure 7: the save fills the disk. One line naming the path (not torch's bare
    `inline_container.cc` failure), the half-written checkpoint removed, the failure recorded; the unit
    tests (tests/unit/test_save_guard.py) show the second failure of the same save stopping the job."""
    run = small_disk / "run"
    tmp = run / "checkpoints" / "step_000001.tmp"
    first = _srpo(_argv(tiny, run, "train.steps=1"))
    assert first.returncode == 2 and "Traceback" not in first.stderr, first.stderr[-3000:]
    assert _last_line(first) == (
        f"srpo train: error: saving checkpoint step 1 to {tmp} failed: no space left on device "
        f"({run / 'checkpoints'}); free space there and rerun"
    )
    assert not tmp.exists()  # the half-written checkpoint does not hold the disk
    record = json.loads((run / ".save_failure.json").read_text())
    assert record["step"] == 1 and record["count"] == 1 and record["needed_bytes"] > 0


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
