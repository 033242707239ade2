"""The no-grad scoring pass of method §3: what the trainer keeps from the student and the teacher.

Student scoring (every sample): log π_old of the sampled tokens [T], and the student's top-K ids [T, K]
for the tokens that will take the SDPO loss. Teacher scoring (only samples that need a teacher): the
teacher's log-probs at those ids plus the tail bucket [T, K+1], its full-vocabulary entropy [T] (for
the dynamic weights) and, for ``advantage_mix``, its log-prob of the sampled token [T]. Nothing of size
[T, V] is kept. Rows are response positions: row t holds the logits that predict ``response_ids[t]``
(the trainer does the shift and aligns the teacher's rows, whose prompt differs, to the same tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from srpo_megatron.ops.fused_output import OutputShard
from srpo_megatron.ops.vocab_parallel import append_tail, token_stats


class StudentScore(NamedTuple):
    """old_logp [T]: log π_old(y_t); topk_ids [T, K]: student top-K global ids (0 on rows not asked);
    at_ids [T, J]: log π_old at the given ``at_ids`` (the engine's top-J, for the parity KL), or None."""

    old_logp: torch.Tensor
    topk_ids: torch.Tensor
    at_ids: torch.Tensor | None = None


class TeacherScore(NamedTuple):
    """logp [T, K+1]: teacher log-probs at the student's top-K ids + tail; entropy [T]; token_logp [T]."""

    logp: torch.Tensor
    entropy: torch.Tensor
    token_logp: torch.Tensor | None


@torch.no_grad()
def score_student(
    logits: torch.Tensor | OutputShard,
    response_ids: torch.Tensor,
    topk_rows: torch.Tensor | None,
    k: int,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    at_ids: torch.Tensor | None = None,
) -> StudentScore:
    """One pass over the student's logits shard [T, V/P]: log π_old(y_t) [T] and top-K ids [T, K].

    ``topk_rows`` [T] bool selects the tokens that need top-K ids (SDPO tokens); None = all rows.
    ``at_ids`` [T, J] global ids: their log-probs come back too (same pass, no vocabulary gather).
    """
    ids = response_ids.reshape(-1, 1)
    stats = token_stats(
        logits,
        ids if at_ids is None else torch.cat([ids, at_ids], dim=1),
        k=k,
        topk_rows=topk_rows,
        group=group,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    return StudentScore(stats.logp[:, 0], stats.topk_ids, None if at_ids is None else stats.logp[:, 1:])


@torch.no_grad()
def score_teacher(
    teacher_logits: torch.Tensor | OutputShard,
    topk_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    response_ids: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> TeacherScore:
    """One pass over the teacher's logits shard [T, V/P] at the student's ``topk_ids`` [T, K].

    Returns teacher log-probs at the ids plus the tail log(1 − Σ_K q) [T, K+1], the full-vocabulary
    entropy [T], and (if ``response_ids`` [T] is given) log q(y_t) [T].
    """
    k = topk_ids.shape[-1]
    ids = topk_ids if response_ids is None else torch.cat([topk_ids, response_ids.reshape(-1, 1)], dim=1)
    stats = token_stats(
        teacher_logits,
        ids,
        with_entropy=True,
        group=group,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    token_logp = None if response_ids is None else stats.logp[:, k]
    return TeacherScore(append_tail(stats.logp[:, :k]), stats.entropy, token_logp)
