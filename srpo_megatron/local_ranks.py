"""Run a function on N local ranks (a benchmark script, the test suite) and collect the results.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` on a free loopback port, calls ``fn(rank, world_size, *args)`` in each, and
returns the list of per-rank return values (anything picklable; tensors are fine).
If any rank raises, the failing rank's full traceback is re-raised in the caller; if the ranks do not
finish within ``timeout`` seconds, they are killed and a ``TimeoutError`` names the ranks still running.
``fn`` must be importable at module level (it is pickled by reference).

Start method: on a CPU-only machine the ranks are forked from a ``forkserver`` that has already imported
torch, megatron-core and transformers (``_PRELOAD``), because importing them costs 5-8 CPU-seconds per
rank and the dist tier starts several hundred ranks. Each rank still gets a fresh interpreter state
for everything else (it is forked from the server, not from pytest) and the caller's current
environment, as a spawned process would. With CUDA present the ranks are spawned: a server that imported
torch next to a CUDA driver is not fork-safe. ``SRPO_DIST_START_METHOD=spawn`` forces spawning.

Backend (:func:`harness_backend`): gloo on CPU. When every rank can have a GPU of its own, rank ``r`` takes
``cuda:r`` and the default group is ``cpu:gloo,cuda:nccl``, what ``parallel.init_distributed`` gives the
product under torchrun: CUDA tensors go over NCCL, host objects over gloo. With fewer GPUs than ranks it
stays gloo (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from srpo_megatron.ports import free_port


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


# Imported once by the forkserver; a module missing here is skipped by multiprocessing (ImportError).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "transformers",
]


def _context() -> mp.context.BaseContext:
    """``forkserver`` with the heavy imports preloaded on CPU-only machines, else ``spawn``."""
    method = os.environ.get("SRPO_DIST_START_METHOD") or "forkserver"
    if method == "forkserver":
        import torch

        if torch.cuda.is_available() or "forkserver" not in mp.get_all_start_methods():
            method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # only takes effect before the server's first start
    return ctx


def harness_backend(world_size: int, cuda_devices: int) -> str:
    """The default group's backend for ``world_size`` ranks on a machine with ``cuda_devices`` GPUs."""
    if 0 < world_size <= cuda_devices:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _worker(fn, rank, world_size, port, args, kwargs, results, env, backend):
    # A forked rank inherits the server's environment from when it started: take the caller's instead.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if "nccl" in backend:
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Serialise to bytes: torch's shared-memory tensor pickling would need this process alive
        # until the parent reads the result.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return per-rank results.

    Under pytest with ``SRPO_TEST_MAX_WORLD_SIZE`` set (the one-GPU smoke check: NCCL cannot put two ranks
    on one GPU), a call for more ranks skips the calling test.
    """
    limit = int(os.environ.get("SRPO_TEST_MAX_WORLD_SIZE") or 0)
    if limit and world_size > limit:
        import pytest

        pytest.skip(f"needs {world_size} ranks; SRPO_TEST_MAX_WORLD_SIZE={limit}")
    ctx = _context()
    import torch

    backend = harness_backend(world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    results = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, args, kwargs, results, child_env, backend),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {running} of {world_size} did not finish within {timeout:.0f}s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RankFailed(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                    ) from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            import torch

            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
