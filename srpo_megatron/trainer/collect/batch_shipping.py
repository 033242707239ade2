"""Move a step's rollouts: the engines' completions to rank 0, then each rank its DP share, once.

A rank's step reads only its data-parallel share of the batch (``batches.rank_share``): the scoring and
learning passes take the share, and the loss normalisers are all-reduced over the DP group
(``losses.global_normalizers``), never computed from other ranks' samples. Routing and group advantages
need whole prompt groups across DP shares, so rank 0 computes them before shipping, and the batch's metrics
(computed by rank 0 over every sample) travel with each share. So:

- :func:`gather_to_rank0`: each engine host sends its completions to rank 0 only (``gather_object``);
- :func:`ship_shares`: rank 0 sends each rank its DP share of the routed samples, MoE routed experts
  included (``scatter_object_list``), and nothing else of the batch.

An MoE rollout's routed experts (rollout routing replay, ``Sample.routed_experts``) are the largest part:
``[tokens, layers, top_k]`` ids per sample, for Qwen3-235B-A22B (94 layers, top-8, uint8) 752 bytes per
token, ~1.7 GB for 32 prompts × 8 samples × 9k tokens. Each rank receives 1/DP of them, and of the token
ids; rank 0 sends one copy per TP/CP/PP rank of each DP replica. ``tools/bench_batch_shipping.py`` measures
the bytes each rank receives against the earlier all-gather + broadcast.

Collectives over ``group``, a gloo group over all ranks (``ParallelGroups.host``; global rank 0 is its
rank 0): every rank calls them.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from srpo_megatron.trainer.microbatches.batches import rank_share
from srpo_megatron.trainer.step_types import RolloutBatch


def _single(group: Any) -> bool:
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def gather_to_rank0(obj: Any, group: Any = None) -> list[Any] | None:
    """Collective: every rank's ``obj`` on rank 0 of ``group``, in rank order; None on the other ranks."""
    if _single(group):
        return [obj]
    rank0 = dist.get_rank(group) == 0
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def broadcast_from_rank0(obj: Any, group: Any = None) -> Any:
    """Collective: rank 0's ``obj`` (small: a failure list) on every rank of ``group``."""
    if _single(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def share_payloads(
    batch: RolloutBatch, dp_of_rank: list[int], mini_batches: int, dp_size: int
) -> list[RolloutBatch]:
    """What each rank receives: its DP share of ``batch.samples`` (mini-batch-major) and the metrics."""
    shares = [rank_share(batch.samples, mini_batches, dp_size, d) for d in range(dp_size)]
    return [RolloutBatch(shares[d], batch.metrics) for d in dp_of_rank]


def ship_shares(
    batch: RolloutBatch | None, *, dp_rank: int, dp_size: int, mini_batches: int, group: Any = None
) -> RolloutBatch:
    """Collective: rank 0's ``batch`` (None elsewhere) split by DP share; every rank of ``group`` gets its
    share (``batches.rank_share(batch.samples, mini_batches, dp_size, dp_rank)``) and the batch metrics."""
    if _single(group):
        assert batch is not None
        return RolloutBatch(rank_share(batch.samples, mini_batches, dp_size, dp_rank), batch.metrics)
    dp_of_rank = gather_to_rank0(dp_rank, group)
    payloads = None
    if dist.get_rank(group) == 0:
        assert batch is not None and dp_of_rank is not None
        payloads = share_payloads(batch, dp_of_rank, mini_batches, dp_size)
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, payloads, src=0, group=group)
    return mine[0]


__all__ = ["broadcast_from_rank0", "gather_to_rank0", "share_payloads", "ship_shares"]
