"""Expert parallelism: every rank of a pass runs the same number of forwards.

With ``parallel.ep`` > 1 every MoE layer's forward (token dispatch) and backward are collectives over the
expert-parallel group, whose ranks belong to different data-parallel replicas (megatron carves EP out of
DP × CP). The passes of a step, though, are data-dependent per DP rank:

- the teacher pass runs only on the samples that need a teacher, which one DP rank may not have at all;
- token-budget packing (``train.max_tokens_per_micro_batch``) gives each DP rank as many micro-batches as
  its own sequences need.

A rank that runs fewer forwards than its EP peers leaves them waiting in the dispatcher's all-gather for
ever (found by the EP2 ``srpo train`` test: DP rank 0 in the teacher pass, DP rank 1 already in the
training pass). ``lockstep`` pads each rank's micro-batches to the DP group's maximum with *filler*
micro-batches: every slot is padding, no row is scored, and the schedule's zero loss still runs the
backward through the expert all-to-alls (``schedule.run_schedule``). Fillers add no loss, no gradient and no
token to any count. Dense models and EP = 1 are left alone (their forwards have no cross-DP collective).

With CP the count is already equal over the CP group (its ranks share the packed micro-batches), so
reducing over the DP group equalises every EP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.trainer.batches import MicroBatch, Sequence, micro_batches_for

_FILLER_TOKENS = 8  # a filler's length where no other micro-batch fixes its shape


def needs_lockstep(groups: ParallelGroups) -> bool:
    """True where a forward is a collective across data-parallel ranks (MoE experts split over EP)."""
    return groups.ep_size > 1 and groups.dp_size > 1


def filler_micro_batch(
    like: list[MicroBatch],
    micro_batch_size: int,
    max_tokens: int,
    pp_size: int,
    device: torch.device,
    *,
    multiple: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> MicroBatch:
    """A micro-batch of padding only (``members`` all None, no logit row), shaped like ``like[0]`` where
    the schedule needs equal shapes (PP's p2p: right-padded passes share a length, packed ones are padded
    to the budget); built by the same ``micro_batches_for`` as the real ones."""
    if like and like[0].packed is None:
        length = like[0].tokens.shape[1]
    else:
        length = max(multiple, 1) * max(1, -(-_FILLER_TOKENS // max(multiple, 1)))
        if max_tokens > 0:
            length = min(length, max_tokens)
    seq = Sequence([0] * length, 0, 0)
    (mb,) = micro_batches_for(
        [seq],
        micro_batch_size,
        max_tokens,
        pp_size,
        device,
        multiple=multiple,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    mb.members = [None] * len(mb.members)
    return mb


def lockstep(
    micro: list[MicroBatch],
    groups: ParallelGroups,
    micro_batch_size: int,
    max_tokens: int,
    layout: dict[str, int],
) -> list[MicroBatch]:
    """``micro`` padded with fillers to the largest count over the DP group (collective where
    ``needs_lockstep``; ``micro`` itself elsewhere). ``layout``: ``context_parallel.micro_batch_layout``."""
    if not needs_lockstep(groups):
        return micro
    count = torch.tensor([len(micro)], dtype=torch.int64, device=groups.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=groups.dp)
    missing = int(count) - len(micro)
    if missing <= 0:
        return micro
    fill = filler_micro_batch(micro, micro_batch_size, max_tokens, groups.pp_size, groups.device, **layout)
    return [*micro, *([fill] * missing)]
