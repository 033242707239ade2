"""Benchmark: the fused output layer (``ops.OutputShard``) against today's output layer + chunked kernels.

Measured in one run, at TP1 and TP2 (gloo, rank r holds the rows ``[r·V/P, (r+1)·V/P)`` of the output
weight; the hidden states are the same on every rank). Per layout and path, one fresh process per rank
does, on fp32 inputs ``hidden [T, H]`` and ``weight [V/P, H]`` (both leaves with ``requires_grad``):

  scoring (no grad):  old log-probs of the sampled tokens + student top-K ids of the SDPO tokens
                      (``score_student``);
  training:           routed SRPO loss (half the tokens GRPO, half SDPO with teacher top-K + tail,
                      dynamic weights, TIS, entropy bonus, as ``tools/bench_losses.py``) + backward to
                      ``hidden`` and ``weight``.

``today``: the output layer's GEMM ``hidden @ weight.T`` builds the logits shard, then the chunked
kernels run on it, and backward goes through both (autograd keeps the logits and builds their gradient).
``fused``: the kernels get ``OutputShard(hidden, weight)``, which never builds the ``[T, V/P]`` logits
(forward GEMMs one chunk at a time; backward recomputes each chunk).

Memory: peak extra over the inputs and over the gradients any path must return (``hidden.grad`` [T, H]
and ``weight.grad`` [V/P, H]), as a multiple of one ``[T, V/P]`` fp32 logits shard. The peak is the
kernel's RSS high-water mark (``VmHWM``, what getrusage's ``ru_maxrss`` reports, so no sampling can miss a
peak), taken over the inputs' RSS once they exist (after a tiny warm-up run). The run is cut into
segments by resetting the mark (``/proc/self/clear_refs`` ``5``) where the returned gradients cannot
exist yet: at the start of backward and, today, when the logits' gradient is complete (before the
output layer's backward makes the two returned gradients). A segment before that point counts whole;
the last one minus the returned gradients' bytes; the largest segment is the figure.
``MALLOC_MMAP_THRESHOLD_`` is 1 MiB so glibc returns freed large blocks to the OS at once and RSS
follows live tensors. Time: CPU seconds (user + system, getrusage) of a 1-thread rank process,
worst rank, the least over ``--repeats`` fresh runs per path (today and fused alternate, so a burst of
other jobs' load hits both): on a shared machine other jobs' load dominates wall time and still inflates
CPU time (shared caches and memory bandwidth), never deflates it. Under TP the hidden gradient is the rank's
partial sum (megatron's region op would all-reduce it); it is the same work on both paths.

Last line printed: one JSON object. ``extra_mem_vs_shard_fused``, ``extra_mem_vs_shard_today`` and
``time_fused_vs_today`` (training pass: forward + backward) are the largest over the layouts measured;
``scoring_time_fused_vs_today`` the same for the scoring pass; ``tp1_*`` / ``tp2_*`` per layout.

    .venv/bin/python tools/bench_fused_output.py [--tokens 4096 --vocab 151936 --hidden 1024 --k 100]
    .venv/bin/python tools/bench_fused_output.py --quick      # a small shape, seconds

``--cuda`` (the GPU check script's line, ``tools/gpu_smoke.sh``): one process on the GPU, bf16, TP1, T 8,192,
V 151,936, H 4,096 (``--quick``: small). Forward + backward of ``−Σ log p(ids)`` through megatron's output
layer (``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``, the baseline), the fused output layer
with its bf16 weight-gradient GEMM (fp32 accumulation; ``ops/fused_output.wgrad_mode``) and the same with
the fp32 GEMM (``WGRAD_HALF = "off"``, the path before): milliseconds (median of 5 after a warm-up),
peak allocated memory, and the weight gradient's relative error against megatron's. Without CUDA it prints
one ``skipped: needs CUDA`` line and its JSON and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import srpo_megatron.ops.fused_output as fused_ops
from srpo_megatron.config import LossConfig
from srpo_megatron.local_ranks import run_distributed
from srpo_megatron.losses import TokenBatch, global_normalizers, routed_loss
from srpo_megatron.losses.scoring import score_student
from srpo_megatron.ops import OutputShard

CFG = LossConfig(top_k=100, entropy_coef=1e-3)
PATHS = ("today", "fused")
QUICK = dict(tokens=256, vocab=8192, hidden=64, k=16)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """The RSS high-water mark since the process started or since the last ``_reset_peak``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: this benchmark needs Linux")


def _reset_peak() -> None:
    """Reset the high-water mark to the current RSS (Linux >= 4.0: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Peaks:
    """Largest segment peak over ``base``; each ``cut`` closes a segment (module doc, Memory)."""

    def __init__(self, base: int):
        self.base, self.extra = base, 0
        _reset_peak()

    def cut(self, returned_grad_bytes: int = 0) -> None:
        self.extra = max(self.extra, _peak_rss() - self.base - returned_grad_bytes)
        _reset_peak()


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
    )


def _inputs(t: int, shard: int, h: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] (same on all ranks) and this rank's weight rows [V/P, H]; logits have std ≈ 2."""
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(shard, h, generator=torch.Generator().manual_seed(100 + rank)).mul_(2 / math.sqrt(h))
    return hidden.requires_grad_(True), weight.requires_grad_(True)


def _logits(path: str, hidden: torch.Tensor, weight: torch.Tensor, peaks: _Peaks | None = None):
    """What the kernels get: today the output layer's product, fused the layer itself."""
    if path == "fused":
        return OutputShard(hidden, weight)
    logits = hidden @ weight.t()
    if peaks is not None and logits.requires_grad:  # its gradient is complete: the layer's backward is next
        logits.register_hook(lambda g: peaks.cut())
    return logits


def _step(path, hidden, weight, f: dict, k: int, group, peaks=None) -> tuple[float, float, float]:
    """Scoring pass, then training pass; returns (loss, CPU s of scoring, CPU s of training)."""
    cpu0 = _cpu_seconds()
    with torch.no_grad():
        score = score_student(_logits(path, hidden, weight), f["response_ids"], f["sdpo"], k, group)
    cpu1 = _cpu_seconds()
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
    loss, _ = routed_loss(_logits(path, hidden, weight, peaks), batch, norm, CFG, group=group)
    if peaks is not None:
        loss.register_hook(lambda g: peaks.cut())  # backward starts: no returned gradient exists yet
    loss.backward()
    return float(loss.detach()), cpu1 - cpu0, _cpu_seconds() - cpu1


def _worker(rank, world, path, t, vocab, h, k, threads, min_chunk_rows):
    torch.set_num_threads(threads)
    if min_chunk_rows:  # the investigation knob (--min-chunk-rows); the default is the module's own
        fused_ops.MIN_CHUNK_ROWS_CPU = min_chunk_rows
    group = dist.group.WORLD if world > 1 else None
    shard = vocab // world
    # Warm-up on a tiny problem so kernels, thread pools and allocator arenas exist before the baseline.
    small = _token_fields(16, 64 * world, 4, seed=1)
    _step(path, *_inputs(16, 64, 8, rank), small, 4, group)
    del small
    f = _token_fields(t, vocab, k, seed=0)
    hidden, weight = _inputs(t, shard, h, rank)  # written: their pages are resident
    if group is not None:
        dist.barrier(group=group)
    peaks = _Peaks(_rss())
    start = time.perf_counter()
    loss, cpu_score, cpu_train = _step(path, hidden, weight, f, k, group, peaks)
    wall = time.perf_counter() - start
    assert hidden.grad is not None and weight.grad is not None
    grads = sum(g.numel() * g.element_size() for g in (hidden.grad, weight.grad))
    peaks.cut(grads)
    return dict(
        scoring=cpu_score,
        training=cpu_train,
        wall=wall,
        extra_bytes=peaks.extra,
        grad_bytes=grads,
        shard_bytes=t * shard * 4,
        loss=loss,
        grad_hidden_norm=float(hidden.grad.norm()),
        grad_weight_norm=float(weight.grad.norm()),
    )


def _layout(out: list[dict]) -> dict:
    """Worst rank of one (layout, path): max CPU seconds, max extra memory."""
    worst = max(out, key=lambda r: r["extra_bytes"] / r["shard_bytes"])
    return dict(
        scoring=max(r["scoring"] for r in out),
        training=max(r["training"] for r in out),
        wall=max(r["wall"] for r in out),
        extra_bytes=worst["extra_bytes"],
        grad_bytes=worst["grad_bytes"],
        shard_bytes=worst["shard_bytes"],
        extra_vs_shard=worst["extra_bytes"] / worst["shard_bytes"],
        loss=out[0]["loss"],
        grad_weight_norm=out[0]["grad_weight_norm"],
    )


CUDA_SHAPE = dict(tokens=8192, vocab=151936, hidden=4096)
CUDA_QUICK = dict(tokens=512, vocab=8192, hidden=256)


def _cuda_time(fn, reps: int = 5) -> tuple[float, float, torch.Tensor]:
    """(median ms, peak allocated GiB over the inputs, the weight gradient) of ``fn`` after one warm-up."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        grad = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[reps // 2], peak, grad


def cuda_main(quick: bool) -> dict:
    """The ``--cuda`` mode (module doc): megatron's output layer vs the fused one, bf16 vs fp32 wgrad."""
    if not torch.cuda.is_available():
        print("bench_fused_output --cuda: skipped: needs CUDA (torch sees no GPU here)", flush=True)
        return {"skipped": "needs CUDA"}
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from srpo_megatron.ops import token_stats
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1)
    t, v, h = (CUDA_QUICK if quick else CUDA_SHAPE).values()
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(t, h, device=dev, dtype=bf16, generator=gen)
    weight = (torch.randn(v, h, device=dev, generator=gen) * (2 / math.sqrt(h))).to(bf16)
    ids = torch.randint(0, v, (t,), device=dev, generator=gen)
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=8, params_dtype=bf16, bf16=True)
    layer = tensor_parallel.ColumnParallelLinear(
        h, v, config=cfg, init_method=lambda w: None, bias=False, gather_output=False
    )
    with torch.no_grad():
        layer.weight.copy_(weight)

    def megatron() -> torch.Tensor:
        layer.weight.grad = None
        logits, _ = layer(hidden[:, None, :].detach().requires_grad_())
        tensor_parallel.vocab_parallel_cross_entropy(logits, ids[:, None]).sum().backward()
        return layer.weight.grad

    def fused(mode: str):
        def run() -> torch.Tensor:
            fused_ops.WGRAD_HALF = mode
            w = weight.detach().requires_grad_()
            stats = token_stats(OutputShard(hidden.detach().requires_grad_(), w), ids[:, None])
            (-stats.logp.float().sum()).backward()
            return w.grad

        return run

    out: dict = {"tokens": t, "vocab": v, "hidden": h, "wgrad_mode": fused_ops.wgrad_mode(weight)}
    ref = None
    for name, fn in (
        ("megatron", megatron),
        ("fused_bf16_wgrad", fused("auto")),
        ("fused_fp32_wgrad", fused("off")),
    ):
        ms, peak, grad = _cuda_time(fn)
        if ref is None:
            ref = grad.float().clone()
        rel = float((grad.float() - ref).norm() / ref.norm())
        out |= {
            f"{name}_ms": round(ms, 2),
            f"{name}_peak_gib": round(peak, 3),
            f"{name}_wgrad_rel_vs_megatron": rel,
        }
        print(
            f"cuda {name:17s} T={t} V={v} H={h} bf16: {ms:.2f} ms fwd+bwd, peak {peak:.3f} GiB, "
            f"weight grad rel. to megatron's {rel:.2e}",
            flush=True,
        )
        del grad
    fused_ops.WGRAD_HALF = "auto"
    out["fused_bf16_vs_fp32_wgrad_time"] = round(out["fused_bf16_wgrad_ms"] / out["fused_fp32_wgrad_ms"], 4)
    out["fused_bf16_vs_megatron_time"] = round(out["fused_bf16_wgrad_ms"] / out["megatron_ms"], 4)
    out["device"] = torch.cuda.get_device_name()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size H (Qwen3-0.6B: 1024)")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help=f"a small shape: {QUICK}")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes to measure")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank process")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="fresh processes per path, today and fused alternating; the least CPU time counts",
    )
    ap.add_argument(
        "--min-chunk-rows",
        type=int,
        default=0,
        help="override ops.fused_ops.MIN_CHUNK_ROWS_CPU in the fused ranks (0: the module's value)",
    )
    ap.add_argument("--cuda", action="store_true", help="the GPU mode (module doc); skipped without CUDA")
    args = ap.parse_args()
    if args.cuda:
        print(json.dumps(cuda_main(args.quick)))
        return
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: needs at least one run per path")
    bad = [tp for tp in args.tp if tp < 1 or args.vocab % tp]
    if bad:
        ap.error(f"--tp {bad[0]}: the vocabulary {args.vocab} must split evenly over a TP size >= 1")
    # Return freed large blocks to the OS at once, so RSS follows live tensors (children inherit it).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    shape = f"T={args.tokens} V={args.vocab} H={args.hidden} K={args.k}"
    res: dict[str, dict[str, dict]] = {}
    for world in args.tp:
        name = f"tp{world}"
        res[name] = {}
        for rep, path in [(rep, path) for rep in range(args.repeats) for path in PATHS]:
            out = run_distributed(
                _worker,
                world,
                path,
                args.tokens,
                args.vocab,
                args.hidden,
                args.k,
                args.threads,
                args.min_chunk_rows,
                timeout=3600,
            )
            r = _layout(out)
            if rep:  # the least CPU time of the repeats (other jobs only ever add to it); the worst memory
                old = res[name][path]
                r |= {key: min(r[key], old[key]) for key in ("scoring", "training", "wall")}
                if old["extra_vs_shard"] > r["extra_vs_shard"]:
                    r |= {key: old[key] for key in ("extra_bytes", "extra_vs_shard")}
            res[name][path] = r
            print(
                f"{name} {path:5s} {shape} (best of {rep + 1}): scoring {r['scoring']:.2f} s + training "
                f"{r['training']:.2f} s "
                f"CPU ({r['wall']:.2f} s wall), peak extra over inputs + grads "
                f"{r['extra_bytes'] / 2**20:.0f} MiB = {r['extra_vs_shard']:.3f} x shard "
                f"({r['shard_bytes'] / 2**20:.0f} MiB; grads {r['grad_bytes'] / 2**20:.0f} MiB), "
                f"loss {r['loss']:.6f}",
                flush=True,
            )
    figures: dict[str, float] = {}
    for name, paths in res.items():
        today, fused = paths["today"], paths["fused"]
        figures |= {
            f"{name}_extra_mem_vs_shard_fused": round(fused["extra_vs_shard"], 4),
            f"{name}_extra_mem_vs_shard_today": round(today["extra_vs_shard"], 4),
            f"{name}_time_fused_vs_today": round(fused["training"] / today["training"], 4),
            f"{name}_scoring_time_fused_vs_today": round(fused["scoring"] / today["scoring"], 4),
            f"{name}_training_seconds_fused": round(fused["training"], 2),
            f"{name}_training_seconds_today": round(today["training"], 2),
            f"{name}_scoring_seconds_fused": round(fused["scoring"], 2),
            f"{name}_scoring_seconds_today": round(today["scoring"], 2),
            f"{name}_shard_mib": round(today["shard_bytes"] / 2**20, 1),
            f"{name}_grads_mib": round(today["grad_bytes"] / 2**20, 1),
            f"{name}_loss_gap": abs(fused["loss"] - today["loss"]),
            f"{name}_grad_weight_norm_rel_gap": abs(fused["grad_weight_norm"] - today["grad_weight_norm"])
            / max(today["grad_weight_norm"], 1e-30),
        }
    worst = {
        key: max(figures[f"{n}_{key}"] for n in res)
        for key in (
            "extra_mem_vs_shard_fused",
            "extra_mem_vs_shard_today",
            "time_fused_vs_today",
            "scoring_time_fused_vs_today",
        )
    }
    summary = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "k": args.k,
        **worst,
        **figures,
        "min_chunk_rows_cpu": args.min_chunk_rows or fused_ops.MIN_CHUNK_ROWS_CPU,
        "repeats": args.repeats,
        "mem_basis": "peak RSS over the inputs and the returned grads (hidden [T,H], weight [V/P,H]), "
        "per [T, V/P] fp32 logits shard, worst rank",
        "time_basis": "training pass (forward + backward) cpu seconds per rank process (max over ranks, "
        "least over the repeats), 1 thread per rank",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
