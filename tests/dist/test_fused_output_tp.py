"""The fused output layer at TP2 over gloo, with and without sequence parallelism, against today's path
(megatron's own ``ColumnParallelLinear`` output layer, then the chunked kernels on its logits) and the float64
full-vocabulary reference: values, the hidden-state gradient (what reaches the decoder: the SP
reduce-scatter or the TP all-reduce of megatron's region ops) and each rank's weight-shard gradient.

The vocabulary is padded (V_real < V/2 · 2), so padded ids live on the last shard; the rows are a scattered
subset of ``[b, S]`` positions, as a micro-batch's response rows are.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.losses_reference import ref_entropy, ref_logp, ref_topk, rel_err

S, B, H, V, V_REAL, K, TAU = 8, 2, 16, 96, 90, 7, 0.9


def _data():
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    weight = 0.4 * torch.randn(V, H, generator=g, dtype=torch.float64)
    rows = torch.rand(B, S, generator=g) < 0.6
    rows[0, 0] = True
    n = int(rows.sum())
    ids = torch.randint(0, V_REAL, (n, 2), generator=g)
    ids[0] = torch.tensor([V_REAL - 1, V // 2])  # ids on both shards, next to the padding
    wts = [torch.randn(s, generator=g, dtype=torch.float64) for s in [(n, 2), (n, K), (n,)]]
    return hidden, weight, rows, ids, wts


def _objective(stats, wts):
    return (
        (stats.logp.double() * wts[0]).sum()
        + (stats.topk_logp.double() * wts[1]).sum()
        + (stats.entropy.double() * wts[2]).sum()
    )


def _worker(rank, world, sp, dtype):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from srpo_megatron.compat.cpu import enable_cpu_compat
    from srpo_megatron.ops import OutputShard, token_stats
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.microbatches.output_rows import hidden_rows, logit_rows

    enable_cpu_compat()
    # The stand-in of tests/dist/test_performance_cpu.py: megatron's SP linear backward allocates on
    # torch.cuda.current_device() inside autograd, outside the CPU layer's thread-local mode.
    torch.cuda.current_device = lambda: torch.device("cpu")
    groups = initialize_model_parallel(world, 1, seed=1)
    tp = groups.tp
    hidden, weight, rows, ids, wts = _data()
    shard = V // world
    w_local = weight[rank * shard : (rank + 1) * shard].to(dtype)
    pad = torch.arange(rank * shard, (rank + 1) * shard) >= V_REAL
    local_in = hidden.chunk(world, dim=0)[rank] if sp else hidden  # [S/TP, b, H] under SP
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        tensor_model_parallel_size=world,
        sequence_parallel=sp,
        params_dtype=dtype,
    )
    layer = tensor_parallel.ColumnParallelLinear(
        H, V, config=cfg, init_method=lambda w: None, bias=False, gather_output=False
    )
    with torch.no_grad():
        layer.weight.copy_(w_local)

    # today: megatron's output layer, then the kernels on the [T, V/TP] rows
    x_today = local_in.to(dtype).clone().requires_grad_()
    logits, _ = layer(x_today)
    today = token_stats(
        logit_rows(logits.transpose(0, 1), rows, pad), ids, k=K, with_entropy=True, group=tp, temperature=TAU
    )
    _objective(today, wts).backward()

    # fused: the same rows' hidden states and the same weight shard, no logits
    x_fused = local_in.to(dtype).clone().requires_grad_()
    w_fused = w_local.clone().requires_grad_()
    shard_in = OutputShard(hidden_rows(x_fused, rows, tp, sp), w_fused, pad)
    fused = token_stats(shard_in, ids, k=K, with_entropy=True, group=tp, temperature=TAU, chunk_tokens=3)
    _objective(fused, wts).backward()
    dist.barrier()
    return dict(
        today=(today.logp, today.topk_logp, today.topk_ids, today.entropy, x_today.grad, layer.weight.grad),
        fused=(fused.logp, fused.topk_logp, fused.topk_ids, fused.entropy, x_fused.grad, w_fused.grad),
    )


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_fused_output_at_tp2_equals_megatrons_output_layer_and_float64(sp, dtype):
    results = run_distributed(_worker, 2, sp, dtype, timeout=300)
    hidden, weight, rows, ids, wts = _data()
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = hr.transpose(0, 1)[rows] @ wr[:V_REAL].T
    r_top, r_ids = ref_topk(z, K, TAU)
    r_lp, r_h = ref_logp(z, ids, TAU), ref_entropy(z, TAU)
    ((r_lp * wts[0]).sum() + (r_top * wts[1]).sum() + (r_h * wts[2]).sum()).backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for path in ("today", "fused"):
        w_grad = torch.cat([r[path][5] for r in results], dim=0)
        assert rel_err(w_grad, wr.grad) < tol, (path, "weight grad")
        assert w_grad[V_REAL:].abs().max() == 0, (path, "padded rows took a gradient")
        for rank, r in enumerate(results):
            lp, top, top_ids, ent, h_grad, _ = r[path]
            assert torch.equal(top_ids, r_ids), (path, rank)
            assert rel_err(lp, r_lp) < tol and rel_err(top, r_top) < tol and rel_err(ent, r_h) < tol
            want_h = hr.grad.chunk(2, dim=0)[rank] if sp else hr.grad
            assert rel_err(h_grad, want_h) < tol, (path, rank, "hidden grad")
    for r in results:  # fused vs today, output by output
        for got, want in zip(r["fused"], r["today"], strict=True):
            assert torch.equal(got, want) if got.dtype == torch.int64 else rel_err(got, want) < tol
