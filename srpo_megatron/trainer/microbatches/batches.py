"""Batch assembly: rollout samples → the tensors the Megatron passes consume, on the runtime's device.

Sequences are ``prompt + response`` right-padded to one length per pass (PP needs fixed p2p shapes). Row
t of a sample is the logit position that predicts response token t (logits at position p predict token
p+1, so response token t sits at ``len(prompt) + t`` and its row is one earlier). Rows are taken from
the ``[b, S, V/TP]`` logits shard with a ``[b, S]`` mask, in sample then position order, which is the
order of the flat per-token tensors of ``losses.TokenBatch`` and of ``step_types.ScoredBatch.tokens``.

Packing (``train.max_tokens_per_micro_batch`` > 0, see ``trainer/microbatches/packing.py``): sequences are
laid end
to end in token-budget micro-batches (THD, ``PackedSeqParams``) instead; a micro-batch then holds tokens
``[1, T]`` and its members in increasing order, so the kept rows are still in sample then position order.
With context parallelism (``parallel.cp`` > 1) a rank holds only its CP chunks ``[1, T/cp]`` and the
micro-batch's ``row_index`` says which of the members' rows those are
(``trainer/microbatches/context_parallel.py``).

Device discipline: everything here is built once on the host (Python lists → tensors) and moved to the
runtime's ``device`` once, at the hand-off (``make_micro_batches``, ``sample_tokens``); the passes never
create host tensors that reach the model or a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from srpo_megatron.losses import TokenBatch
from srpo_megatron.trainer.microbatches import packing
from srpo_megatron.trainer.step_types import Sample


@dataclass(frozen=True)
class Sequence:
    """One forward input: token ids, and the rows [first, first + num_rows) whose logits are kept."""

    ids: list[int]
    first: int
    num_rows: int


@dataclass
class MicroBatch:
    """Input of one forward, on the runtime's device.

    tokens [b, S] int64, positions [1, S] int64, rows [b, S] bool (logit rows kept), and ``members``:
    which sequence (index into the pass's list) each of the b slots holds (None = padding slot).
    Packed: b = 1, positions [1, S] restart at 0 in every sequence, ``members`` are the packed sequences
    in order and ``packed`` carries their boundaries (megatron ``PackedSeqParams``, on the device).
    Context parallel: tokens, positions and rows are this CP rank's chunks (S = T/cp of the packed T),
    ``row_index`` [R_local] indexes the members' flat rows that ``rows`` selects, ``packed`` stays global.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    members: list[int | None]
    packed: Any = None
    row_index: torch.Tensor | None = None  # CP: this rank's rows among the members' rows (None = all)
    cp_size: int = 1  # the packed length is tokens.shape[1] · cp_size

    @property
    def seq_length(self) -> int:
        """Tokens of the whole (un-split) micro-batch: what megatron's schedule is told (it divides by CP)."""
        return self.tokens.shape[1] * self.cp_size

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """[R_local] the entries of ``rows`` ([R], the members' flat rows) whose logits this rank holds."""
        return rows if self.row_index is None else rows[self.row_index]

    def local_tokens(self, batch: TokenBatch) -> TokenBatch:
        """This rank's rows of ``batch`` (the members' per-token tensors, in member then position order)."""
        return batch if self.row_index is None else batch.take(self.row_index)


def student_sequences(samples: list[Sample]) -> list[Sequence]:
    return [
        Sequence(s.prompt_ids + s.response_ids, len(s.prompt_ids) - 1, len(s.response_ids)) for s in samples
    ]


def teacher_sequences(samples: list[Sample]) -> list[Sequence]:
    """The teacher sees its own prompt (method §1.4) followed by the same response tokens."""
    out = []
    for s in samples:
        if s.teacher_prompt_ids is None:
            raise ValueError(f"sample {s.group}/{s.member} needs a teacher but has no teacher prompt")
        out.append(
            Sequence(
                s.teacher_prompt_ids + s.response_ids, len(s.teacher_prompt_ids) - 1, len(s.response_ids)
            )
        )
    return out


def padded_len(seqs: list[Sequence], multiple: int = 8) -> int:
    longest = max((len(s.ids) for s in seqs), default=1)
    return int(math.ceil(longest / multiple) * multiple)


def make_micro_batches(
    seqs: list[Sequence], micro_batch_size: int, seq_len: int, device: torch.device
) -> list[MicroBatch]:
    """Consecutive groups of ``micro_batch_size`` sequences (the last one padded with empty slots)."""
    out = []
    positions = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).to(device)
    for start in range(0, len(seqs), micro_batch_size):
        tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        rows = torch.zeros(micro_batch_size, seq_len, dtype=torch.bool)
        members: list[int | None] = []
        for b in range(micro_batch_size):
            k = start + b
            if k >= len(seqs):
                members.append(None)
                continue
            s = seqs[k]
            tokens[b, : len(s.ids)] = torch.tensor(s.ids, dtype=torch.long)
            rows[b, s.first : s.first + s.num_rows] = True
            members.append(k)
        out.append(MicroBatch(tokens.to(device), positions, rows.to(device), members))
    return out


def make_packed_micro_batches(
    seqs: list[Sequence],
    max_tokens: int,
    multiple: int,
    fixed: bool,
    device: torch.device,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> list[MicroBatch]:
    """Token-budget micro-batches (first-fit decreasing), each packed end to end; ``fixed`` pads every one
    to ``max_tokens`` (pipeline parallelism: megatron's p2p shapes are fixed). With ``cp_size`` > 1 each is
    this CP rank's share (chunks ``cp_rank`` and ``2·cp_size−1−cp_rank`` of every sequence)."""
    triples = [(s.ids, s.first, s.num_rows) for s in seqs]
    out = []
    for members in packing.plan_micro_batches([len(s.ids) for s in seqs], max_tokens, multiple):
        mb = packing.pack(triples, members, multiple, total=max_tokens if fixed else None)
        shard = packing.cp_shard(mb, cp_size, cp_rank)
        out.append(
            MicroBatch(
                shard.tokens.to(device),
                shard.positions.to(device),
                shard.rows.to(device),
                list(members),
                mb.packed_seq_params(device),
                shard.row_index.to(device) if cp_size > 1 else None,
                cp_size,
            )
        )
    return out


def micro_batches_for(
    seqs: list[Sequence],
    micro_batch_size: int,
    max_tokens: int,
    pp_size: int,
    device: torch.device,
    *,
    multiple: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> list[MicroBatch]:
    """The pass's micro-batches: packed by token budget when ``max_tokens`` > 0, else right-padded.

    ``multiple``: each packed sequence's padding (``packing.pad_multiple``); ``cp_size``/``cp_rank``: the
    context-parallel split (needs packing).
    """
    if max_tokens > 0:
        return make_packed_micro_batches(seqs, max_tokens, multiple, pp_size > 1, device, cp_size, cp_rank)
    if cp_size > 1:
        raise ValueError("context parallelism needs packed micro-batches (train.max_tokens_per_micro_batch)")
    return make_micro_batches(seqs, micro_batch_size, padded_len(seqs), device)


def row_offsets(samples: list[Sample]) -> list[int]:
    """[N + 1] host offsets: sample i's response rows are ``[offsets[i], offsets[i + 1])``."""
    out = [0]
    for s in samples:
        out.append(out[-1] + len(s.response_ids))
    return out


def token_versions(sample: Sample) -> list[int]:
    """The weight version that generated each response token (one version unless partial)."""
    if sample.token_versions is None:
        return [sample.weight_version] * len(sample.response_ids)
    if len(sample.token_versions) != len(sample.response_ids):
        raise ValueError(
            f"sample {sample.uid or (sample.group, sample.member)} has {len(sample.token_versions)} token "
            f"versions for {len(sample.response_ids)} response tokens; the engine must report one per token"
        )
    return sample.token_versions


def assistant_rows(sample: Sample) -> list[bool]:
    """Which response rows are the model's own tokens: every row for a single-turn sample
    (``response_mask`` None), else ``response_mask[t] == 1`` (multi-turn: the tool/user turns' tokens
    between assistant turns are 0, scored as context and never trained on).

    The one place the multi-turn mask enters the trainer: ``sample_tokens`` folds it into
    ``TokenBatch.mask`` (so every loss, count, denominator and statistic that reads the mask leaves tool
    tokens out) and ``passes/parity.engine_top_k`` into the parity KL's rows, both on the host.
    """
    n = len(sample.response_ids)
    if sample.response_mask is None:
        return [True] * n
    mask = sample.response_mask
    who = sample.uid or f"{sample.group}/{sample.member}"
    if len(mask) != n or any(m not in (0, 1) for m in mask):
        raise ValueError(
            f"sample {who} has a response_mask of {len(mask)} entries (values {sorted(set(mask))}) for {n} "
            "response tokens; the rollout must give one 0/1 entry per response token (1 = the engine's own)"
        )
    return [m == 1 for m in mask]


def sample_tokens(
    samples: list[Sample],
    top_k: int,
    device: torch.device,
    *,
    trainer_version: int | None = None,
    max_staleness: int = 0,
) -> TokenBatch:
    """The rollout side of a ``TokenBatch`` over ``samples`` (flat rows, no padding), on ``device``.

    The scoring pass fills ``old_logp``, ``topk_ids`` and the teacher fields in place; they start at 0.
    ``mask`` holds the assistant rows (``assistant_rows``): a multi-turn sample's tool/user tokens are
    context only, in no loss, count or statistic.
    ``trainer_version`` (None = unknown: ``stale`` stays None): a token is stale when
    ``trainer_version − its version > max_staleness`` (``rollout.off_policy_steps``).
    """
    n = [len(s.response_ids) for s in samples]
    t = sum(n)
    per_row = lambda values, dtype: torch.repeat_interleave(  # noqa: E731
        torch.tensor(values, dtype=dtype), torch.tensor(n, dtype=torch.long)
    )
    host = TokenBatch(
        response_ids=torch.tensor([i for s in samples for i in s.response_ids], dtype=torch.long),
        mask=torch.tensor([m for s in samples for m in assistant_rows(s)], dtype=torch.bool),
        advantages=per_row([s.advantage for s in samples], torch.float32),
        grpo=per_row([s.grpo for s in samples], torch.bool),
        sdpo=per_row([s.sdpo for s in samples], torch.bool),
        old_logp=torch.zeros(t, dtype=torch.float32),
        rollout_logp=torch.tensor([x for s in samples for x in s.rollout_logp], dtype=torch.float32),
        topk_ids=torch.zeros(t, top_k, dtype=torch.long),
        teacher_logp=torch.zeros(t, top_k + 1, dtype=torch.float32),
        teacher_entropy=torch.zeros(t, dtype=torch.float32),
        teacher_token_logp=torch.zeros(t, dtype=torch.float32),
        teacher=torch.zeros(t, dtype=torch.bool),
        stale=None
        if trainer_version is None
        else torch.tensor(
            [trainer_version - v > max_staleness for s in samples for v in token_versions(s)],
            dtype=torch.bool,
        ),
    )
    return host.to(device)


def rank_share(samples: list[Sample], mini_batches: int, dp_size: int, dp_rank: int) -> list[Sample]:
    """This DP rank's samples of a rollout batch: its slice of each mini-batch, mini-batch-major."""
    out: list[Sample] = []
    for mini in split_even(samples, mini_batches):
        out.extend(split_even(mini, dp_size)[dp_rank])
    return out


def split_even(items: list, n: int) -> list[list]:
    if len(items) % n:
        raise ValueError(
            f"{len(items)} samples cannot be split evenly into {n} parts; make rollout.prompts_per_step × "
            "rollout.group_size divisible by train.mini_batches × data-parallel size"
        )
    k = len(items) // n
    return [items[i * k : (i + 1) * k] for i in range(n)]
