"""Batch assembly: rollout samples → the tensors the Megatron passes consume, on the runtime's device.

Sequences are ``prompt + response`` right-padded to one length per pass (PP needs fixed p2p shapes). Row
t of a sample is the logit position that predicts response token t (logits at position p predict token
p+1, so response token t sits at ``len(prompt) + t`` and its row is one earlier). Rows are taken from
the ``[b, S, V/TP]`` logits shard with a ``[b, S]`` mask, in sample then position order, which is the
order of the flat per-token tensors of ``losses.TokenBatch`` and of ``ScoredBatch.tokens``.

Device discipline: everything here is built once on the host (Python lists → tensors) and moved to the
runtime's ``device`` once, at the hand-off (``make_micro_batches``, ``ScoredBatch.on``); the passes never
create host tensors that reach the model or a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from srpo_megatron.losses import TokenBatch
from srpo_megatron.trainer.rollouts import Sample
from srpo_megatron.trainer.stats import StepStats


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
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    members: list[int | None]


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


def row_offsets(samples: list[Sample]) -> list[int]:
    """[N + 1] host offsets: sample i's response rows are ``[offsets[i], offsets[i + 1])``."""
    out = [0]
    for s in samples:
        out.append(out[-1] + len(s.response_ids))
    return out


def sample_tokens(samples: list[Sample], top_k: int, device: torch.device) -> TokenBatch:
    """The rollout side of a ``TokenBatch`` over ``samples`` (flat rows, no padding), on ``device``.

    The scoring pass fills ``old_logp``, ``topk_ids`` and the teacher fields in place; they start at 0.
    """
    n = [len(s.response_ids) for s in samples]
    t = sum(n)
    per_row = lambda values, dtype: torch.repeat_interleave(  # noqa: E731
        torch.tensor(values, dtype=dtype), torch.tensor(n, dtype=torch.long)
    )
    host = TokenBatch(
        response_ids=torch.tensor([i for s in samples for i in s.response_ids], dtype=torch.long),
        mask=torch.ones(t, dtype=torch.bool),
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
    )
    return host.to(device)


@dataclass
class ScoredBatch:
    """This rank's share of one rollout batch after the scoring pass (method §3), ready for training.

    samples: N samples, mini-batch-major (mini-batch j is ``samples[j·N/M : (j+1)·N/M]``).
    offsets: N + 1 host ints; sample i owns rows ``[offsets[i], offsets[i + 1])`` of ``tokens``.
    tokens: ``TokenBatch`` over T = Σ response lengths rows on the runtime's device, holding π_old [T],
        the student's top-K ids [T, K] and the teacher's log-probs [T, K+1], entropy [T] and sampled-token
        log-prob [T]. Only the last pipeline stage sees logits, so other stages hold None.
    stats: the scoring pass's own stats (times, teacher forwards).
    """

    samples: list[Sample]
    offsets: list[int]
    tokens: TokenBatch | None
    stats: StepStats

    def select(self, start: int, end: int) -> ScoredBatch:
        """Samples ``[start, end)`` with their rows (views of ``tokens``, no copies)."""
        a, b = self.offsets[start], self.offsets[end]
        return ScoredBatch(
            self.samples[start:end],
            [o - a for o in self.offsets[start : end + 1]],
            None if self.tokens is None else self.tokens.slice(a, b),
            StepStats(),
        )

    def mini_batches(self, m: int) -> list[ScoredBatch]:
        """The ``m`` mini-batches (one optimizer step each) in order."""
        k = len(self.samples) // m
        return [self.select(j * k, (j + 1) * k) for j in range(m)]

    def micro_tokens(self, members: list[int | None]) -> TokenBatch:
        """Rows of a micro-batch's (consecutive) members, as views."""
        idx = [i for i in members if i is not None]
        assert self.tokens is not None and idx == list(range(idx[0], idx[-1] + 1))
        return self.tokens.slice(self.offsets[idx[0]], self.offsets[idx[-1] + 1])


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
