"""A tiny all-reduce across the node's GPUs: NCCL, the GPUs and their links work together.

One process per GPU (spawned, as torchrun would), a 1M-element fp32 all-reduce of ``rank + 1``, result
checked against ``world * (world + 1) / 2``, under a timeout: a hung NCCL (a bad NVLink, a wrong
``NCCL_*`` setting) shows as a failed line, not a job that sits until its time limit. The same code runs
on CPU with gloo, which is how the tests exercise it.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

from srpo_megatron.doctor.report import Check, fail, ok
from srpo_megatron.ports import free_port

NUMEL = 1 << 20  # 4 MiB of fp32: big enough to use the real transport, small enough to be instant


def _worker(rank: int, world: int, port: int, backend: str, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        x = torch.full((NUMEL,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: communicator set-up
        x.fill_(float(rank + 1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        results.put((rank, float(x.min().item()), float(x.max().item()), seconds, ""))
        dist.destroy_process_group()
    except Exception as e:  # reported by the parent as this rank's failure
        results.put((rank, float("nan"), float("nan"), 0.0, f"{type(e).__name__}: {e}"))


def run_allreduce(
    world: int, backend: str = "nccl", timeout: float = 120.0, start_ranks: int | None = None
) -> Check:
    """All-reduce over ``world`` local processes (``backend`` nccl: one per GPU) and check the sum.

    ``start_ranks`` < ``world`` starts only that many processes: the rest never join, as when one GPU's
    process hangs (tests use it to show the timeout is reported).
    """
    name = f"{backend} all-reduce"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, results), daemon=True)
        for r in range(world if start_ranks is None else start_ranks)
    ]
    for p in procs:
        p.start()
    expected = world * (world + 1) / 2
    got: dict[int, tuple[float, float, float, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, lo, hi, seconds, error = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            got[rank] = (lo, hi, seconds, error)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    fix = "check `nvidia-smi topo -m`, NCCL_* settings (NCCL_DEBUG=INFO shows the transport) and the GPUs"
    if len(got) < world:
        missing = sorted(set(range(world)) - set(got))
        return fail(name, f"{world} ranks: rank(s) {missing} did not finish within {timeout:.0f} s", fix)
    errors = [f"rank {r}: {e}" for r, (_, _, _, e) in sorted(got.items()) if e]
    if errors:
        return fail(name, "; ".join(errors), fix)
    wrong = [r for r, (lo, hi, _, _) in got.items() if lo != expected or hi != expected]
    if wrong:
        return fail(name, f"wrong sum on rank(s) {sorted(wrong)} (expected {expected:g})", fix)
    slowest = max(s for _, _, s, _ in got.values())
    gbps = NUMEL * 4 * 2 * (world - 1) / world / slowest / 1e9  # ring all-reduce bus bandwidth
    return ok(name, f"{world} ranks, {NUMEL * 4 >> 20} MiB in {slowest * 1e3:.1f} ms (~{gbps:.1f} GB/s bus)")


def check_allreduce(gpu_count: int, nccl_available: bool) -> Check:
    if gpu_count < 2:
        return ok("nccl all-reduce", f"skipped ({gpu_count} GPU(s): nothing to reduce across)")
    if not nccl_available:
        return fail("nccl all-reduce", f"{gpu_count} GPUs but no NCCL in torch", "use the pinned container")
    return run_allreduce(gpu_count, "nccl")
