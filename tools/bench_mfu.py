"""Benchmark: training tokens/s and MFU of a randomly initialised policy, activation recompute off and on.

One process, one rank (TP1/PP1/DP1). The policy is built exactly as the trainer builds it
(``models/performance.py`` choosers: bf16 params with fp32 main params and grads on CUDA, fusions where
available, megatron DDP + distributed-optimizer-free Adam) with the local layer spec, and trained on
random tokens with megatron's own next-token loss (``GPTModel(..., labels=)``) through
``get_forward_backward_func``: warm-up steps, then timed optimizer steps.

MFU = model FLOPs per second / ``--peak-tflops``. Model FLOPs per token follow the PaLM convention
(appendix B of arXiv 2204.02311): ``6·N + 12·L·s·d_attn`` with N the matmul parameters (attention and
MLP projections and the LM head; embeddings lookups and norms excluded), L layers, s the sequence
length and ``d_attn = heads·head_dim``; causal masking is not discounted and recompute is not counted
(it costs time, so it lowers MFU). The peak is the GPU's dense bf16 figure, a parameter: ~790 TFLOP/s was
measured on an H200 (the default); use the datasheet or a measured GEMM peak for other GPUs. Without
CUDA, ``--shape tiny`` runs a tiny shape on the CPU (fp32) and MFU is reported only if a peak is given.

Last line printed: one JSON object.

    python tools/bench_mfu.py                         # Qwen3-1.7B shape, seq 4096, recompute none,full
    python tools/bench_mfu.py --shape tiny --seq 64 --steps 2 --warmup 1   # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B): 28 layers, hidden 2048, 16 heads / 8 KV heads of 128, tied.
SHAPES = {
    "qwen3-1.7b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
    ),
    "tiny": dict(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}


def model_flops_per_token(arch, seq: int) -> float:
    """PaLM-convention training FLOPs per token (forward + backward), see the module docstring."""
    d_attn = arch.num_heads * arch.head_dim
    d_kv = arch.num_kv_heads * arch.head_dim
    per_layer = arch.hidden_size * (d_attn + 2 * d_kv) + d_attn * arch.hidden_size
    per_layer += 3 * arch.hidden_size * arch.intermediate_size
    matmul_params = arch.num_layers * per_layer + arch.vocab_size * arch.hidden_size  # + LM head
    return 6.0 * matmul_params + 12.0 * arch.num_layers * seq * d_attn


def run_mode(arch, recompute: str, seq: int, mbs: int, steps: int, warmup: int) -> dict:
    """Build, warm up and time one recompute mode; tokens/s and peak memory."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.config import OptimConfig, PerformanceConfig
    from srpo_megatron.models import performance as perf
    from srpo_megatron.models.policy import build_policy

    acc = perf.Accelerators.detect()
    cfg = PerformanceConfig(layer_spec="local", recompute=recompute)
    dtype = perf.params_dtype("auto", acc)
    overrides = perf.transformer_overrides(cfg, sequence_parallel=False, acc=acc)
    device = torch.device("cuda") if acc.cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = build_policy(arch, params_dtype=dtype, use_te=False, max_sequence_length=seq, **overrides)
    model = model.to(device)
    ddp_config = perf.ddp_config(cfg, distributed_optimizer=False, acc=acc)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        perf.optimizer_config(OptimConfig(lr=1e-5, warmup_steps=0), dtype=dtype, ddp=ddp_config), [ddp]
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, arch.vocab_size, (mbs, seq + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(seq, device=device).unsqueeze(0)
    fb = get_forward_backward_func()

    def forward_step(data_iterator, m):
        next(data_iterator)
        per_token = m(inputs, positions, None, labels=labels)  # [b, s] fp32 cross entropy

        def loss_func(out):
            loss = out.float().mean()
            return loss, {"loss": loss.detach()}

        return per_token, loss_func

    def step() -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = fb(
            forward_step_func=forward_step,
            data_iterator=iter([0]),
            model=[ddp],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        optimizer.step()
        return float(losses[0]["loss"]) if losses else float("nan")

    sync = torch.cuda.synchronize if acc.cuda else (lambda: None)
    first = step()
    for _ in range(max(warmup - 1, 0)):
        step()
    sync()
    if acc.cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    last = first
    for _ in range(steps):
        last = step()
    sync()
    elapsed = time.perf_counter() - start
    out = dict(
        tokens_per_s=steps * mbs * seq / elapsed,
        step_s=elapsed / steps,
        first_loss=first,
        last_loss=last,
        peak_mem_gib=(torch.cuda.max_memory_allocated() / 2**30) if acc.cuda else None,
    )
    ddp = optimizer = model = None  # freed before the next mode is built
    gc.collect()
    if acc.cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    ap.add_argument("--seq", type=int, default=4096, help="sequence length (tokens per sample)")
    ap.add_argument("--micro-batch", type=int, default=1, help="samples per step")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    ap.add_argument("--recompute", default="none,full", help="comma-separated: none, selective, full")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak of the device in TFLOP/s (default on CUDA: 790, measured on an H200)",
    )
    args = ap.parse_args()

    import torch

    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.parallel import destroy_model_parallel, initialize_model_parallel

    cuda = torch.cuda.is_available()
    if args.shape != "tiny" and not cuda:
        sys.exit(f"--shape {args.shape} needs a GPU; use --shape tiny on the CPU")
    peak = args.peak_tflops if args.peak_tflops is not None else (790.0 if cuda else None)
    arch = Architecture.from_hf(SHAPES[args.shape])
    flops_per_token = model_flops_per_token(arch, args.seq)
    initialize_model_parallel(1, 1, seed=0)
    summary: dict = dict(
        bench="mfu",
        device=torch.cuda.get_device_name() if cuda else "cpu",
        shape=args.shape,
        seq=args.seq,
        micro_batch=args.micro_batch,
        steps=args.steps,
        params_dtype="bf16" if cuda else "fp32",
        layer_spec="local",
        peak_tflops=peak,
        model_tflop_per_token=flops_per_token / 1e12,
    )
    try:
        for mode in args.recompute.split(","):
            r = run_mode(arch, mode, args.seq, args.micro_batch, args.steps, args.warmup)
            tflops = r["tokens_per_s"] * flops_per_token / 1e12
            summary[f"recompute_{mode}"] = dict(
                tokens_per_s=round(r["tokens_per_s"], 1),
                model_tflops=float(f"{tflops:.4g}"),
                mfu=float(f"{tflops / peak:.4g}") if peak else None,
                step_s=round(r["step_s"], 4),
                peak_mem_gib=round(r["peak_mem_gib"], 2) if r["peak_mem_gib"] is not None else None,
                loss_first=round(r["first_loss"], 4),
                loss_last=round(r["last_loss"], 4),
            )
            print(f"recompute={mode}: {summary[f'recompute_{mode}']}", file=sys.stderr, flush=True)
    finally:
        destroy_model_parallel()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
