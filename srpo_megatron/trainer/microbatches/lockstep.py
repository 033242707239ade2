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

from collections.abc import Callable

import torch
import torch.distributed as dist

from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.trainer.microbatches.batches import MicroBatch, Sequence

Build = Callable[[list[Sequence]], list[MicroBatch]]  # the pass's own ``micro_batches_for`` call


def needs_lockstep(groups: ParallelGroups) -> bool:
    """True where a forward is a collective across data-parallel ranks (MoE experts split over EP)."""
    return groups.ep_size > 1 and groups.dp_size > 1


def filler_micro_batch(like: list[MicroBatch], build: Build) -> MicroBatch:
    """A micro-batch of padding only (``members`` all None, no logit row), built by the pass's own
    ``build``, so it has the shapes the schedule needs: right-padded passes share the length of ``like``
    (PP's p2p), packed ones pad the one-token sequence to the TP/CP multiple, or to the budget under PP."""
    length = like[0].tokens.shape[1] if like and like[0].packed is None else 1
    (mb,) = build([Sequence([0] * length, 0, 0)])
    mb.members = [None] * len(mb.members)
    return mb


def lockstep(micro: list[MicroBatch], groups: ParallelGroups, build: Build) -> list[MicroBatch]:
    """``micro`` padded with fillers to the largest count over the DP group (collective where
    ``needs_lockstep``; ``micro`` itself elsewhere). ``build``: how the pass made ``micro``."""
    if not needs_lockstep(groups):
        return micro
    count = torch.tensor([len(micro)], dtype=torch.int64, device=groups.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=groups.dp)
    missing = int(count) - len(micro)
    if missing <= 0:
        return micro
    return [*micro, *([filler_micro_batch(micro, build)] * missing)]
