"""Ship rank 0's rollout batch to every rank: the plain batch to all, routed experts to their DP share.

Every rank needs the whole batch's samples (token ids, rewards, routing, teacher prompts: a few bytes per
token) so that all ranks agree on routing and advantages. An MoE rollout's routed experts (rollout routing
replay, ``Sample.routed_experts``) are far larger, ``[tokens, layers, top_k]`` ids per sample: for
Qwen3-235B-A22B (94 layers, top-8, uint8) 752 bytes per token, ~1.7 GB for 32 prompts × 8 samples × 9k
tokens. A rank only ever reads those of its own data-parallel share (``batches.rank_share``), so they are
scattered: each rank receives its DP share's experts, and the broadcast carries none. The bytes each rank
receives fall by the DP size; rank 0 sends one copy per TP/CP/PP rank of each DP replica instead of one
per rank.

A collective over ``group``, a gloo group over all ranks (``ParallelGroups.host``; global rank 0 is its
rank 0): every rank calls :func:`ship_batch`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from srpo_megatron.trainer.batches import rank_share


def ship_batch(batch: Any, *, dp_rank: int, dp_size: int, mini_batches: int, group: Any = None) -> Any:
    """Rank 0's ``batch`` (a ``RolloutBatch``; None elsewhere) on every rank of ``group``, each sample's
    ``routed_experts`` present only on the ranks whose DP share holds the sample (None elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        assert batch is not None
        return batch
    rank0 = dist.get_rank(group) == 0
    routed: list[Any] = []
    if rank0:
        routed = [s.routed_experts for s in batch.samples]
        for s in batch.samples:
            s.routed_experts = None
    box = [(batch, any(r is not None for r in routed))]
    dist.broadcast_object_list(box, src=0, group=group)
    batch, has_routed = box[0]
    if not has_routed:
        return batch
    dp_of_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(dp_of_rank, dp_rank, group=group)
    payloads = None
    if rank0:
        indices = list(range(len(batch.samples)))
        shares = [rank_share(indices, mini_batches, dp_size, d) for d in range(dp_size)]
        payloads = [{i: routed[i] for i in shares[d] if routed[i] is not None} for d in dp_of_rank]
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, payloads, src=0, group=group)
    for i, ids in mine[0].items():
        batch.samples[i].routed_experts = ids
    return batch


__all__ = ["ship_batch"]
