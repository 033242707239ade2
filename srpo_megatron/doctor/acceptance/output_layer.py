"""The fused output layer (``ops.OutputShard``) against megatron's ``ColumnParallelLinear`` +
``vocab_parallel_cross_entropy``: same per-token loss and gradients, its time and peak memory.

On CUDA: bf16 at T = 8k tokens, V = 152k (Qwen's 151936), H = 4096, forward + backward of the summed
token loss on each path (one warm-up, then one timed run), peak memory over the inputs from
``torch.cuda.max_memory_allocated``; the fused path must use less. Without CUDA: fp32 at a small size, the
numerics only. Both paths are also held to a float64 reference on the first rows. One rank (TP1) in a
child process (``local_ranks.run_distributed``: gloo on CPU, NCCL on a GPU).
"""

from __future__ import annotations

import contextlib
import sys
import time

from srpo_megatron.doctor.acceptance.registry import AcceptanceCheck, Context, Outcome, failed, passed

GPU_SHAPE = dict(tokens=8192, vocab=151936, hidden=4096)
CPU_SHAPE = dict(tokens=256, vocab=4096, hidden=64)
REF_ROWS = 256  # rows checked against float64
TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # rel. error (max |a - b| / max |b|) of values and gradients


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _path(fn, cuda: bool) -> tuple[dict, float, float | None]:
    """Run ``fn`` (forward + backward, returns its tensors) warm, then timed: (outputs, ms, peak GiB)."""
    import torch

    fn()  # warm-up: cuBLAS handles, allocator pools
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return out, ms, peak


def _worker(rank: int, world: int, tokens: int, vocab: int, hidden_size: int, dtype_name: str) -> dict:
    """The rank's work; anything it prints goes to stderr: the doctor's stdout carries only JSON lines."""
    with contextlib.redirect_stdout(sys.stderr):
        return _measure(tokens, vocab, hidden_size, dtype_name)


def _measure(tokens: int, vocab: int, hidden_size: int, dtype_name: str) -> dict:
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from srpo_megatron.compat.cpu import enable_cpu_compat
    from srpo_megatron.ops import OutputShard, token_stats
    from srpo_megatron.parallel import initialize_model_parallel

    enable_cpu_compat()
    groups = initialize_model_parallel(1, 1, seed=1)
    cuda = torch.cuda.is_available()
    dev, dtype = torch.device("cuda" if cuda else "cpu"), getattr(torch, dtype_name)
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=dev).to(dtype)
    weight = (0.02 * torch.randn(vocab, hidden_size, generator=gen, device=dev)).to(dtype)
    ids = torch.randint(0, vocab, (tokens,), generator=gen, device=dev)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden_size, num_attention_heads=1, params_dtype=dtype,
        use_cpu_initialization=not cuda, bf16=dtype == torch.bfloat16,
    )  # fmt: skip
    layer = tensor_parallel.ColumnParallelLinear(
        hidden_size, vocab, config=cfg, init_method=lambda w: None, bias=False, gather_output=False
    )
    with torch.no_grad():
        layer.weight.copy_(weight)

    def megatron_path():
        layer.weight.grad = None
        x = hidden[:, None, :].clone().requires_grad_()  # [s, b, h]
        logits, _ = layer(x)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, ids[:, None])[:, 0]
        loss.sum().backward()
        return {"loss": loss.detach(), "dx": x.grad[:, 0], "dw": layer.weight.grad}

    def fused_path():
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        stats = token_stats(OutputShard(x, w), ids[:, None], group=groups.tp)
        loss = -stats.logp[:, 0]
        loss.sum().backward()
        return {"loss": loss.detach(), "dx": x.grad, "dw": w.grad}

    ref, ref_ms, ref_peak = _path(megatron_path, cuda)
    got, got_ms, got_peak = _path(fused_path, cuda)
    n = min(REF_ROWS, tokens)
    z = hidden[:n].double() @ weight.double().T
    exact = -torch.log_softmax(z, dim=-1).gather(-1, ids[:n, None])[:, 0]
    return {
        "loss_vs_megatron": _rel(got["loss"], ref["loss"]),
        "dhidden_vs_megatron": _rel(got["dx"], ref["dx"]),
        "dweight_vs_megatron": _rel(got["dw"], ref["dw"]),
        "fused_loss_vs_fp64": _rel(got["loss"][:n], exact),
        "megatron_loss_vs_fp64": _rel(ref["loss"][:n], exact),
        "megatron_ms": round(ref_ms, 1),
        "fused_ms": round(got_ms, 1),
        "megatron_peak_gib": None if ref_peak is None else round(ref_peak, 3),
        "fused_peak_gib": None if got_peak is None else round(got_peak, 3),
    }


def judge(m: dict, dtype_name: str, cuda: bool) -> Outcome:
    """The numbers against ``dtype_name``'s tolerance; on CUDA the fused path must also use less memory."""
    tol = TOL[dtype_name]
    errs = {k: v for k, v in m.items() if k.endswith(("_vs_megatron", "_vs_fp64"))}
    bad = {k: f"{v:.2e}" for k, v in errs.items() if not v <= tol}
    if bad:
        return failed(f"{dtype_name}: errors above {tol:g}: {bad}", **m)
    timing = f"fwd+bwd fused {m['fused_ms']} ms vs megatron {m['megatron_ms']} ms"
    if cuda:
        if not m["fused_peak_gib"] < m["megatron_peak_gib"]:
            return failed(
                f"fused peak {m['fused_peak_gib']} GiB is not below megatron's {m['megatron_peak_gib']} GiB",
                **m,
            )
        timing += f"; peak {m['fused_peak_gib']} vs {m['megatron_peak_gib']} GiB"
    worst = max(errs.values())
    return passed(
        f"{dtype_name}: agrees with megatron and float64 (max rel. error {worst:.1e}); {timing}", **m
    )


def check_output_layer(ctx: Context) -> Outcome:
    from srpo_megatron.local_ranks import run_distributed

    cuda = ctx.probes.cuda_available()
    shape, dtype_name = (GPU_SHAPE, "bfloat16") if cuda else (CPU_SHAPE, "float32")
    args = (shape["tokens"], shape["vocab"], shape["hidden"], dtype_name)
    (metrics,) = run_distributed(_worker, 1, *args, timeout=ctx.timeout_s)
    shape_txt = "T {tokens}, V {vocab}, H {hidden}".format(**shape)
    out = judge(metrics, dtype_name, cuda)
    return Outcome(out.status, f"{shape_txt}, {out.detail}", out.metrics)


CHECKS = (
    AcceptanceCheck(
        "fused_output_layer",
        "the fused output layer gives megatron's ColumnParallelLinear + vocab_parallel_cross_entropy "
        "loss and gradients (and float64's), in less memory on a GPU; fwd+bwd ms and peak memory reported",
        "set performance.fused_output: 'off' in the recipe and report these numbers",
        check_output_layer,
    ),
)
