"""Token-budget micro-batches and THD sequence packing, with the context-parallel split.

RL response lengths are long-tailed: right-padding every sample to the step's longest sequence spends most
of the compute on padding. Here samples are bin-packed by token count (first-fit decreasing) into
micro-batches of at most ``max_tokens`` tokens and laid end to end in megatron's THD format: tokens
``[1, T]`` plus ``cu_seqlens`` (``PackedSeqParams``). Attention is block-diagonal causal, so no token sees
another sequence (TE's attention on GPU; ``models.attention.SDPACoreAttention`` on CPU).

Each sequence is padded to a multiple of ``pad_multiple`` (2·CP with context parallelism, times TP with
sequence parallelism): CP splits every sequence into 2·CP equal chunks and sequence parallelism splits the
packed tokens over TP. Under pipeline parallelism every micro-batch is padded to the full budget with one
trailing padding sequence, because megatron's p2p shapes are fixed per schedule.

Rows: as in the padded layout, row p of the logits predicts token p+1, and ``rows`` marks the logit rows
that predict response tokens, in member then position order — the order of the flat per-token tensors of
``losses.TokenBatch``. With CP each rank holds chunks ``r`` and ``2·CP−1−r`` of every sequence; within a
sequence these are in increasing position order, so a rank's rows are an ordered subset of the global rows
and ``CPShard.row_index`` says which entries of the flat per-token tensors they are.

The objective is unchanged by packing: the routed loss divides by the global token count, whatever the
micro-batches are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# (token ids of prompt + response, first logit row that predicts a response token, number of such rows)
Seq = tuple[list[int], int, int]


def pad_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """Each packed sequence is padded to this: 2·CP chunks (CP > 1), times TP under sequence parallel."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_micro_batches(lengths: list[int], max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """First-fit decreasing: sample indices per micro-batch, each micro-batch ≤ ``max_tokens`` padded tokens.

    Samples keep their input order inside a micro-batch; micro-batches come largest-first. Raises when one
    sample alone exceeds the budget (it could never be scheduled).
    """
    if max_tokens % multiple:
        raise ValueError(
            f"train.max_tokens_per_micro_batch={max_tokens} must be a multiple of {multiple} "
            "(2·CP, times TP with sequence parallel); round it up"
        )
    padded = [round_up(n, multiple) for n in lengths]
    too_long = [(i, p) for i, p in enumerate(padded) if p > max_tokens]
    if too_long:
        i, p = max(too_long, key=lambda x: x[1])
        raise ValueError(
            f"sample {i} needs {p} tokens (prompt + response, padded to a multiple of {multiple}) but "
            f"train.max_tokens_per_micro_batch={max_tokens}; raise the budget to at least {p} or lower "
            "data.max_prompt_tokens / rollout.max_new_tokens"
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(padded)), key=lambda i: -padded[i]):
        for b, free in enumerate(room):
            if padded[i] <= free:
                bins[b].append(i)
                room[b] -= padded[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - padded[i])
    return [sorted(b) for b in bins]


@dataclass
class PackedMicroBatch:
    """Whole sequences laid end to end (THD), before the CP split. T = total padded tokens.

    tokens:      [1, T] int64 token ids (0 in padding)
    positions:   [1, T] int64 position of each token inside its own sequence
    rows:        [1, T] bool, logit rows that predict a response token (member then position order)
    cu_seqlens:  [n+1] int32 cumulative real lengths; cu_seqlens_padded [n+1] the padded ones
    members:     index into the packed ``seqs`` of each sequence (the trailing PP padding has none)
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    members: list[int]

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max())

    def packed_seq_params(self, device: torch.device | str):
        """megatron ``PackedSeqParams`` for this micro-batch, on the runtime's ``device`` (TE reads them)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device)
        cu_padded = self.cu_seqlens_padded.to(device)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack(
    seqs: list[Seq], members: list[int], multiple: int = 1, total: int | None = None
) -> PackedMicroBatch:
    """Lay ``seqs[m]`` (``m`` in ``members``) end to end; ``total`` pads to a fixed size (PP)."""
    lengths = [len(seqs[m][0]) for m in members]
    padded = [round_up(n, multiple) for n in lengths]
    used = sum(padded)
    if total is not None:
        if total < used or (total - used) % multiple:
            raise ValueError(f"cannot pad a micro-batch of {used} tokens to {total} in steps of {multiple}")
        if total > used:
            lengths.append(0)  # the trailing padding sequence: no real tokens, attends only to itself
            padded.append(total - used)
    size = sum(padded)
    tokens = torch.zeros(1, size, dtype=torch.long)
    positions = torch.zeros(1, size, dtype=torch.long)
    rows = torch.zeros(1, size, dtype=torch.bool)
    start = 0
    for m, n_pad in itertools.zip_longest(members, padded):
        if m is not None:
            ids, first, n = seqs[m]
            tokens[0, start : start + len(ids)] = torch.tensor(ids, dtype=torch.long)
            rows[0, start + first : start + first + n] = True
        positions[0, start : start + n_pad] = torch.arange(n_pad)
        start += n_pad
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    cu_padded = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32)
    return PackedMicroBatch(tokens, positions, rows, cu, cu_padded, list(members))


@dataclass
class CPShard:
    """One CP rank's part of a ``PackedMicroBatch``: its chunks of every sequence, in order.

    index:      [T/cp] global token positions held by this rank
    tokens, positions, rows: [1, T/cp] (``rows`` selects this rank's logit rows)
    row_index:  [R_local] index of each local row into the micro-batch's flat per-token tensors
    """

    index: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    row_index: torch.Tensor


def cp_index(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Global positions ``[T/cp]`` of CP ``rank``: chunks ``rank`` and ``2·cp−1−rank`` of each sequence."""
    parts = []
    for start, end in itertools.pairwise(cu_seqlens_padded.tolist()):
        c = (end - start) // (2 * cp)
        if c * 2 * cp != end - start:
            raise ValueError(f"a packed sequence of {end - start} tokens does not split into {2 * cp} chunks")
        parts.append(torch.arange(start + rank * c, start + (rank + 1) * c))
        parts.append(torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
    return torch.cat(parts)


def cp_shard(mb: PackedMicroBatch, cp: int, rank: int) -> CPShard:
    """This CP rank's tokens and rows (CP = 1: the whole micro-batch)."""
    index = torch.arange(mb.tokens.size(1)) if cp == 1 else cp_index(mb.cu_seqlens_padded, cp, rank)
    flat_row = torch.cumsum(mb.rows[0].long(), 0) - 1  # position -> index into the flat per-token tensors
    local_rows = mb.rows[:, index]
    return CPShard(
        index=index,
        tokens=mb.tokens[:, index],
        positions=mb.positions[:, index],
        rows=local_rows,
        row_index=flat_row[index][local_rows[0]],
    )


def padding_waste(lengths: list[int], bins: list[list[int]], budget: int | None, multiple: int = 1) -> float:
    """Tokens processed ÷ real tokens for packed micro-batches (``budget``: PP pads each to it)."""
    if budget is not None:
        processed = budget * len(bins)
    else:
        processed = sum(round_up(lengths[i], multiple) for b in bins for i in b)
    return processed / sum(lengths)
