"""Benchmark: the SRPO loss (scoring pass + training forward/backward) on a Qwen-sized vocabulary.

Compares this project's vocab-parallel, chunked implementation at TP1 and TP2 (gloo) with a naive
single-process one that materialises [T, V] fp32 tensors (``log_softmax``, ``softmax``, ``torch.topk``),
measured in the same run. Per variant, one fresh process per rank does:

  scoring (no grad):  old log-probs of the sampled tokens + student top-K ids of the SDPO tokens;
  training:           routed SRPO loss (half the tokens GRPO, half SDPO with teacher top-K + tail,
                      dynamic weights, TIS, entropy bonus so the entropy path is exercised) + backward.

Memory: each rank runs in a fresh process; peak extra memory = the process's peak RSS (getrusage
``ru_maxrss``, a kernel high-water mark, so no sampling can miss a peak) − the RSS once the logits exist
(after a small warm-up run) − the bytes of the logits' gradient. ``MALLOC_MMAP_THRESHOLD_`` is set to
1 MiB so glibc returns every large freed block to the OS and RSS tracks live tensors. Reported as a
ratio to the rank's logits-shard bytes. Time: CPU seconds (user + system, getrusage) of scoring +
training, one torch thread per rank process, worst rank; wall-clock is printed too, but on a shared
2-core machine other jobs' load dominates it, while CPU time of a 1-thread process is what its wall
time would be on an idle core.

Last line printed: one JSON object. ``extra_mem_vs_shard``, ``naive_mem_over_ours`` and ``time_vs_naive``
are for TP1; ``tp2_*`` the same at TP2 (per rank, the worst rank).

    .venv/bin/python tools/bench_losses.py [--tokens 4096 --vocab 151936 --k 100] [--device cuda]

With ``--device cuda`` (one GPU): naive and TP1 only, GPU allocator peak and synchronised wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.config import LossConfig
from srpo_megatron.local_ranks import run_distributed
from srpo_megatron.losses import (
    TokenBatch,
    global_normalizers,
    grpo_token_loss,
    routed_loss,
    sdpo_token_loss,
)
from srpo_megatron.losses.scoring import score_student
from srpo_megatron.losses.sdpo import dynamic_weights
from srpo_megatron.ops import append_tail

CFG = LossConfig(top_k=100, entropy_coef=1e-3)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _token_fields(t: int, vocab: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-token data identical on all ranks: half the tokens SDPO, teacher buckets, rollout log-probs."""
    gen = torch.Generator().manual_seed(seed)
    sdpo = torch.arange(t) % 2 == 1
    old = -2.0 * torch.rand(t, generator=gen)
    return dict(
        response_ids=torch.randint(0, vocab, (t,), generator=gen),
        mask=torch.ones(t, dtype=torch.bool),
        advantages=torch.randn(t, generator=gen),
        grpo=~sdpo,
        sdpo=sdpo,
        rollout_logp=old + 0.1 * torch.randn(t, generator=gen),
        teacher_logp=torch.log_softmax(torch.randn(t, k + 1, generator=gen), dim=-1),
        teacher_entropy=3.0 * torch.rand(t, generator=gen),
        old_hint=old,
    )


def _ours(logits: torch.Tensor, f: dict, k: int, group) -> float:
    """Scoring pass then training pass with this project's functions; returns the loss."""
    score = score_student(logits, f["response_ids"], f["sdpo"], k, group)
    batch = TokenBatch(
        response_ids=f["response_ids"],
        mask=f["mask"],
        advantages=f["advantages"],
        grpo=f["grpo"],
        sdpo=f["sdpo"],
        old_logp=score.old_logp,
        rollout_logp=f["rollout_logp"],
        topk_ids=score.topk_ids,
        teacher_logp=f["teacher_logp"],
        teacher_entropy=f["teacher_entropy"],
    )
    norm = global_normalizers([batch], CFG.beta)
    logits.requires_grad_(True)
    loss, _ = routed_loss(logits, batch, norm, CFG, group=group)
    loss.backward()
    return float(loss.detach())


def _naive(logits: torch.Tensor, f: dict, k: int) -> float:
    """The same computation on materialised [T, V] fp32 log_softmax / softmax / topk."""
    with torch.no_grad():
        lp = torch.log_softmax(logits, dim=-1)
        old = lp.gather(1, f["response_ids"][:, None]).squeeze(1)
        topk_ids = torch.topk(lp, k, dim=-1).indices
        del lp
    logits.requires_grad_(True)
    lp = torch.log_softmax(logits, dim=-1)
    ent = -(torch.softmax(logits, dim=-1) * lp).sum(-1)
    logp = lp.gather(1, f["response_ids"][:, None]).squeeze(1)
    g = f["grpo"]
    loss_g, _ = grpo_token_loss(
        logp, old, f["advantages"], f["rollout_logp"], entropy=ent, entropy_coef=CFG.entropy_coef
    )
    rows = f["sdpo"].nonzero().squeeze(1)
    loss_s, _ = sdpo_token_loss(
        append_tail(lp[rows].gather(1, topk_ids[rows])),
        f["teacher_logp"][rows],
        logp[rows],
        old[rows],
        f["rollout_logp"][rows],
    )
    h = f["teacher_entropy"][rows]
    loss_s = loss_s * dynamic_weights(h, torch.ones_like(h, dtype=torch.bool), CFG.beta)
    loss = (torch.where(g, loss_g, 0.0).sum() + loss_s.sum()) / f["mask"].sum()
    loss.backward()
    return float(loss.detach())


def _worker(rank, world, variant, t, vocab, k, threads, device="cpu"):
    torch.set_num_threads(threads)
    group = dist.group.WORLD if world > 1 else None
    shard = vocab // world
    cuda = device == "cuda"
    # Warm-up on a tiny problem so kernels, thread pools and allocator arenas exist before the baseline.
    small = {n: v.to(device) for n, v in _token_fields(16, 64 * world, 4, seed=1).items()}
    small_logits = torch.randn(16, 64, device=device)
    if variant == "naive":
        _naive(small_logits, small, 4)
    else:
        _ours(small_logits, small, 4, group)
    del small, small_logits
    f = {n: v.to(device) for n, v in _token_fields(t, vocab, k, seed=0).items()}
    gen = torch.Generator().manual_seed(100 + rank)
    logits = torch.randn(t, shard, generator=gen).mul_(2.0).to(device)  # written: its pages are resident
    if group is not None:
        dist.barrier(group=group)
    if cuda:  # on the GPU: allocator high-water mark and synchronised wall time
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss()
    cpu0, start = _cpu_seconds(), time.perf_counter()
    loss = _naive(logits, f, k) if variant == "naive" else _ours(logits, f, k, group)
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu0
    shard_bytes = logits.numel() * logits.element_size()
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss()
    extra = peak - base - logits.grad.numel() * logits.grad.element_size()
    return dict(
        seconds=wall if cuda else cpu, wall=wall, extra_bytes=extra, shard_bytes=shard_bytes, loss=loss
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank process")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU, naive and TP1 only (NCCL cannot put two ranks on one GPU); time = synchronised "
        "wall seconds, memory = CUDA allocator peak",
    )
    args = ap.parse_args()
    # Return freed large blocks to the OS at once, so RSS follows live tensors (children inherit it).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    res = {}
    layouts = (("naive", 1), ("tp1", 1)) if args.device == "cuda" else (("naive", 1), ("tp1", 1), ("tp2", 2))
    for variant, world in layouts:
        threads = args.threads
        out = run_distributed(
            _worker, world, variant, args.tokens, args.vocab, args.k, threads, args.device, timeout=1800
        )
        worst = max(out, key=lambda r: r["extra_bytes"] / r["shard_bytes"])
        res[variant] = dict(
            seconds=max(r["seconds"] for r in out),
            wall=max(r["wall"] for r in out),
            extra_bytes=worst["extra_bytes"],
            shard_bytes=worst["shard_bytes"],
            extra_vs_shard=worst["extra_bytes"] / worst["shard_bytes"],
            loss=out[0]["loss"],
        )
        r = res[variant]
        print(
            f"{variant:5s} T={args.tokens} V={args.vocab} K={args.k}: {r['seconds']:.2f} s CPU "
            f"({r['wall']:.2f} s wall), peak extra "
            f"{r['extra_bytes'] / 2**20:.0f} MiB = {r['extra_vs_shard']:.3f} x shard "
            f"({r['shard_bytes'] / 2**20:.0f} MiB), loss {r['loss']:.5f}",
            flush=True,
        )
    if args.device == "cuda":
        naive, tp1 = res["naive"], res["tp1"]
        print(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "tokens": args.tokens,
                    "vocab": args.vocab,
                    "k": args.k,
                    "extra_mem_vs_shard": round(tp1["extra_vs_shard"], 4),
                    "naive_extra_mem_vs_shard": round(naive["extra_vs_shard"], 4),
                    "time_vs_naive": round(tp1["seconds"] / naive["seconds"], 4),
                    "naive_seconds": round(naive["seconds"], 4),
                    "tp1_seconds": round(tp1["seconds"], 4),
                    "loss_gap": abs(tp1["loss"] - naive["loss"]),
                    "time_basis": "synchronised wall seconds on the GPU (one rank)",
                }
            )
        )
        return
    naive, tp1, tp2 = res["naive"], res["tp1"], res["tp2"]
    summary = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "k": args.k,
        "extra_mem_vs_shard": round(tp1["extra_vs_shard"], 4),
        "naive_extra_mem_vs_shard": round(naive["extra_vs_shard"], 4),
        "naive_mem_over_ours": round(naive["extra_bytes"] / max(tp1["extra_bytes"], 1), 2),
        "time_vs_naive": round(tp1["seconds"] / naive["seconds"], 4),
        "tp2_extra_mem_vs_shard": round(tp2["extra_vs_shard"], 4),
        "tp2_time_vs_naive": round(tp2["seconds"] / naive["seconds"], 4),
        "naive_seconds": round(naive["seconds"], 2),
        "tp1_seconds": round(tp1["seconds"], 2),
        "tp2_seconds": round(tp2["seconds"], 2),
        "naive_wall_seconds": round(naive["wall"], 2),
        "tp1_wall_seconds": round(tp1["wall"], 2),
        "tp2_wall_seconds": round(tp2["wall"], 2),
        "time_basis": "cpu seconds per rank process (max over ranks), 1 thread per rank",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
