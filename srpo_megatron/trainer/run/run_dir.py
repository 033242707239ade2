"""The run directory, checked and locked before the model loads.

:func:`claim_run_dir` (collective) is the first thing ``srpo train`` does to ``run.dir``: global rank 0
refuses, in one line, a ``run.dir`` that is a file, cannot be created or is not writable, and a
``checkpoints/latest`` that is not a file; then it takes an exclusive ``flock`` on ``<run.dir>/.lock``
and writes its host and pid there. A second trainer on the same directory is refused naming that host
and pid. The kernel drops the lock when the holding process dies (``kill -9`` included), so a
requeued job starts at once. Every rank of a job gets rank 0's verdict, so no rank refuses its own
job's lock (only rank 0 takes it; the other ranks write checkpoint shards under rank 0's lock).

``flock`` is advisory and local to one kernel on some network filesystems (NFS emulates it with POSIX
locks across clients; Lustre needs the ``flock`` mount option): where it is unsupported the run says so
once and goes on unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

from srpo_megatron.config import ConfigError
from srpo_megatron.trainer.run.save_guard import save_failure_problem

LOCK_FILE = ".lock"
_HELD: dict[str, int] = {}  # resolved run dir -> the open, locked file (one per process)


def run_dir_problem(run_dir: str) -> str | None:
    """Why ``run_dir`` cannot hold a run (creating it when missing), or None."""
    if not str(run_dir).strip():
        return "run.dir is empty: the run would write into the current directory; set run.dir=runs/NAME"
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        return (
            f"run.dir={run_dir} is a file, not a directory; point run.dir at a directory (created if missing)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"run.dir={run_dir} cannot be created ({e.strerror or e}); point run.dir at a writable place"
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return (
            f"run.dir={run_dir} is not writable ({e.strerror or e}); make it writable or point run.dir at "
            "another directory"
        )
    latest = path / "checkpoints" / "latest"
    if (path / "checkpoints").exists() and not (path / "checkpoints").is_dir():
        return f"{path / 'checkpoints'} is a file; remove or rename it (checkpoints are saved in that folder)"
    if latest.exists() and not latest.is_file():
        return (
            f"{latest} is a directory, not the text file naming the newest checkpoint; remove or rename it "
            "(the run resumes from the newest checkpoint that verifies and rewrites it at the next save)"
        )
    return None


def lock_run_dir(run_dir: str, log: Callable[[str], None] = print) -> str | None:
    """Take the run directory's lock for this process (kept until :func:`release_run_dir` or death).
    Returns why it cannot be taken (another live process holds it), or None."""
    path = Path(run_dir).resolve()
    if str(path) in _HELD:  # this process holds it already (a second train() in one process)
        return None
    lock = path / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            log(
                f"warning: {lock} cannot be locked ({e.strerror}); a second trainer on run.dir is not refused"
            )
            return None
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that wrote no host/pid"
        os.close(fd)
        return (
            f"run.dir={run_dir} is in use by another trainer ({holder}, lock {lock}); stop that one, or "
            "pick another run.dir"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    _HELD[str(path)] = fd
    return None


def release_run_dir(run_dir: str) -> None:
    """Drop this process's lock on ``run_dir`` (no-op when it holds none)."""
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor releases the flock


def check_run_dir_early(run_dir: str, log: Callable[[str], None] = print) -> None:
    """``srpo train`` before torch loads (every process): the checks of :func:`claim_run_dir` that need
    no process group, and the lock when this is a single-process run (no torchrun ``RANK``: the same
    test as ``parallel.init_distributed``). Under torchrun the lock waits for rank 0 in ``claim_run_dir``."""
    single = "RANK" not in os.environ
    quiet: Callable[[str], None] = log if single or os.environ.get("RANK") == "0" else (lambda _: None)
    problem = run_dir_problem(run_dir) or save_failure_problem(run_dir, quiet)
    if problem is None and single:
        problem = lock_run_dir(run_dir, log)
    if problem:
        raise ConfigError(problem)


def claim_run_dir(run_dir: str, log: Callable[[str], None] = print) -> None:
    """Collective: rank 0 checks and locks ``run_dir``; every rank raises its verdict (ConfigError)."""
    import torch.distributed as dist

    problem = None
    if (not dist.is_initialized() or dist.get_rank() == 0) and str(Path(run_dir).resolve()) not in _HELD:
        problem = run_dir_problem(run_dir) or lock_run_dir(run_dir, log) or save_failure_problem(run_dir, log)
        if problem:
            release_run_dir(run_dir)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError(problem)
