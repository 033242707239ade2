"""The planner's DDP buffer and optimizer-state counts equal what megatron-core allocates (CPU, gloo).

A tiny bf16 Qwen3 policy at TP 2 x DP 2 under megatron DDP with the distributed optimizer (one bucket
per buffer, as the trainer runs today): the param and grad buffers' sizes and each rank's fp32 main
params and Adam moments (after one optimizer step) are compared with ``buffer_numel`` /
``optimizer_shard_numel`` on the planner's own tensor list.
"""

import pytest

from srpo_megatron.testing.distributed import run_distributed

TINY = dict(
    model_type="qwen3",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _allocated(rank: int, world: int, bucket_size: int | None) -> dict:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(tp=2, pp=1)
    model = build_policy(TINY, params_dtype=torch.bfloat16, bf16=True, use_te=False)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=bucket_size is not None,
            bucket_size=bucket_size,
        ),
        model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True
        ),
        [ddp],
    )
    for p in model.parameters():
        p.main_grad.fill_(1e-3)
    optimizer.step()
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    main = sum(p.numel() for group in inner.optimizer.param_groups for p in group["params"])  # fp32 shards
    moments = sum(
        t.numel()
        for state in inner.optimizer.state.values()
        for k, t in state.items()
        if k.startswith("exp_avg")
    )
    return {
        "param_buffer": sum(b.param_data.numel() for b in ddp.buffers),
        "grad_buffer": sum(b.grad_data.numel() for b in ddp.buffers),
        "main_params": main,
        "moments": moments,
    }


# Small buckets (overlap_grad_reduce) did not finish within 600 s on the shared 2-core CPU; the bucket
# rule is covered by test_buffer_padding_rule and checked against megatron here with one bucket.
@pytest.mark.parametrize("bucket_size", [None], ids=["one-bucket"])
def test_planner_buffers_and_optimizer_state_equal_megatron(bucket_size):
    from srpo_megatron.planner.model import (
        Layout,
        ModelShape,
        buffer_numel,
        optimizer_shard_numel,
        param_tensors,
    )

    got = run_distributed(_allocated, 4, bucket_size, timeout=600)
    tensors = param_tensors(ModelShape.from_hf(TINY), Layout(tp=2, dp=2), 0)
    buf = buffer_numel(tensors, 2, True, bucket_size)
    assert all(g["param_buffer"] == buf and g["grad_buffer"] == buf for g in got), (buf, got)
    busiest = max(g["main_params"] for g in got)
    assert busiest == optimizer_shard_numel(tensors, 2, True, bucket_size), got
    assert all(g["moments"] == 2 * g["main_params"] for g in got)
    # Padding carries no optimizer state: the busiest rank holds less than a full slice of the buffer.
    assert busiest <= buf // 2
