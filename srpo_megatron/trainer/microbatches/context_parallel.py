"""Context parallelism in the trainer's passes: which rows a CP rank scores and trains, and how the CP
group puts the per-token results back together. Pure functions over an explicit CP process group.

With ``parallel.cp`` > 1 every packed sequence is split into 2·CP chunks (``trainer/microbatches/packing.py``)
and each
CP rank of a data-parallel replica runs the model on its chunks of the *same* samples. Per-token tensors
therefore follow one rule: every CP rank keeps the replica's full flat per-token tensors (``TokenBatch``
rows in sample then position order), and a micro-batch's ``row_index`` (``packing.CPShard.row_index``)
names the rows whose logits this rank holds.

- Scoring: each rank writes π_old / top-K ids (then the teacher's fields) into the rows it holds and
  leaves the others at 0; :func:`gather_rows` sums the fields over the CP group, so every rank ends with
  every row. The teacher's sequences split differently from the student's (its prompt is longer), so its
  rows land on other CP ranks than the student's rows of the same tokens: the student's top-K ids must be
  gathered before the teacher pass, and the teacher's results after it.
- Training: the loss inputs of a rank are its rows of the full tensors (``TokenBatch.take(row_index)``).
  The global normalisers are computed from the full tensors and reduced over DP only (each token counted
  once, not once per CP rank). megatron's schedule multiplies each loss by CP and DDP averages the grads
  over DP×CP (``get_data_parallel_group(with_context_parallel=True)``), so the grads are the sum over the
  CP ranks' partial losses, the gradient of the whole objective.
- Stats: each rank's loss sums cover only its rows; :func:`reduce_stats_over` combines them over the CP
  group with each field's declared reduction, after which one CP rank counts them.

On GPU the CP group is NCCL: the reduced tensors are on the runtime's device.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from srpo_megatron.losses import TokenBatch
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.trainer.microbatches.packing import pad_multiple
from srpo_megatron.trainer.step_types import SUM, StepStats

STUDENT_FIELDS = ("old_logp", "topk_ids")  # written by the student scoring pass
TEACHER_FIELDS = ("teacher_logp", "teacher_entropy", "teacher_token_logp")  # written by the teacher pass


@torch.no_grad()
def gather_rows(tokens: TokenBatch, fields: tuple[str, ...], group: dist.ProcessGroup | None) -> None:
    """In place: ``fields`` of ``tokens`` summed over the CP ``group`` (no-op without one).

    Every row is held by exactly one CP rank and the others hold 0 there, so the sum is an exact gather
    (x + 0 = x in every dtype). Collective over ``group``; call on every CP rank.
    """
    for name in fields:
        gather_tensor(getattr(tokens, name), group)


@torch.no_grad()
def gather_tensor(rows: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """In place: one per-row tensor summed over the CP ``group`` (see ``gather_rows``); collective."""
    if group is None or dist.get_world_size(group) == 1:
        return
    dist.all_reduce(rows, group=group)


def reduce_stats_over(stats: StepStats, group: dist.ProcessGroup | None, device: torch.device) -> StepStats:
    """``stats`` reduced over ``group`` field by field (sum or max, as declared); collective.

    For the CP group: each CP rank's loss sums cover its own rows only, so after this every CP rank holds
    the micro-batches' totals and exactly one of them may count them (``StepStats.counted_once``).
    """
    if group is None or dist.get_world_size(group) == 1:
        return stats
    fields = dataclasses.fields(StepStats)
    sums = [f.name for f in fields if f.metadata["reduce"] == SUM]
    maxes = [f.name for f in fields if f.metadata["reduce"] != SUM]
    packed = [
        torch.tensor([getattr(stats, n) for n in names], dtype=torch.float64) for names in (sums, maxes)
    ]
    s, m = (t.to(device) for t in packed)
    dist.all_reduce(s, group=group)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    values = dict(zip(sums, s.tolist(), strict=True)) | dict(zip(maxes, m.tolist(), strict=True))
    return dataclasses.replace(stats, **values)


def micro_batch_layout(groups: ParallelGroups, sequence_parallel: bool) -> dict[str, int]:
    """``micro_batches_for`` keywords of this rank: per-sequence padding multiple and its CP split."""
    return {
        "multiple": pad_multiple(groups.tp_size, groups.cp_size, sequence_parallel),
        "cp_size": groups.cp_size,
        "cp_rank": groups.cp_rank,
    }
