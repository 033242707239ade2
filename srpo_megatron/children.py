"""Child processes die with the trainer, so that a ``kill -9`` of ``srpo train`` leaves none behind.

A killed trainer runs none of its clean-up, so every child it started must notice the death itself:

- :func:`exit_when_orphaned` at the top of a spawned child's entry point (the reward workers, the SGLang
  engine child, megatron's results-queue manager via :func:`megatron_results_queue`): a daemon thread
  that ends the child once it is reparented (its parent *process* is gone, whichever thread started it);
- :func:`kill_forks_with_me`: an ``os.register_at_fork`` hook, so that megatron-core 0.16's forked
  checkpoint writers (``FileSystemWriterAsync``, forked by the main thread; a forked child runs no thread
  of ours) get a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, :func:`die_with_parent`).
  Only forks of the main thread get it: the kernel sends that signal when the *thread* that forked exits.

The children hold no state worth saving: a half-written checkpoint is discarded on resume. Elsewhere
than Linux the signal is not set (the orphan check still works). A leaf: standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any

_PR_SET_PDEATHSIG = 1
_PRCTL: Any = None  # libc's prctl once bound (False: unavailable)
_installed = False
_fork_parent: int | None = None  # set in the parent just before a fork (main thread only), read in the child


def _prctl() -> Any:
    """libc's ``prctl``, bound once in the parent (a forked child must not ``dlopen``), or None."""
    global _PRCTL
    if _PRCTL is None and sys.platform.startswith("linux"):
        try:
            _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _PRCTL = False
    return _PRCTL or None


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; True when set.

    ``parent_pid``: the parent the caller expects; if it already died (before the signal was armed) this
    process is reparented and kills itself at once, as the signal would have."""
    prctl = _prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def exit_when_orphaned(parent_pid: int, interval_s: float = 0.5) -> None:
    """End this process (exit status 1) as soon as ``parent_pid`` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="srpo-exit-when-orphaned", daemon=True).start()


def _before_fork() -> None:
    global _fork_parent
    main = threading.current_thread() is threading.main_thread()
    _fork_parent = os.getpid() if main else None


def _after_fork_in_child() -> None:
    if _fork_parent is not None:
        die_with_parent(_fork_parent)


def kill_forks_with_me() -> None:
    """From now on every ``fork()`` of this process's main thread makes a child that dies with it
    (once per process; ``subprocess`` and ``spawn`` children exec without running fork hooks)."""
    global _installed
    if _installed or not hasattr(os, "register_at_fork"):
        return
    _installed = True
    _prctl()  # bound here, in the parent
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def megatron_results_queue() -> Any:
    """Shim for megatron-core's ``dist_checkpointing`` writer (0.16.1 and 0.19.2): the results queue it
    creates on first save lives in a spawned ``multiprocessing`` manager that outlives a killed trainer
    (parent pid 1, forever). Creating that manager here, before megatron does, with
    :func:`exit_when_orphaned` as its initializer, makes it die with the trainer; megatron reuses the queue
    from its module global ``_results_queue``. Returns the queue (None when megatron has no such global)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        return None
    if filesystem_async._results_queue is None:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=exit_when_orphaned, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
        filesystem_async._srpo_manager = manager  # kept alive with the queue, as megatron's own
    return filesystem_async._results_queue
