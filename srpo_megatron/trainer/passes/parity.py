"""The scoring pass's parity inputs and stats: the engine's top-K per response token against the trainer's
log-probs at the same ids (``rollout.parity_top_k``; the KL itself is ``losses/parity.py``).

:func:`engine_top_k` lays the samples' engine top-K out in the flat row order of ``ScoredBatch.tokens``
(sample then position), on the runtime's device, once. The scoring pass writes each row's KL into a [T]
float64 tensor (rows whose logits another CP rank holds stay 0, so the CP gather is a sum, as in
``context_parallel.gather_rows``), and :func:`parity_stats` reduces it into ``StepStats``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srpo_megatron.trainer.microbatches.batches import assistant_rows
from srpo_megatron.trainer.step_types import Sample, StepStats


@dataclass
class EngineTopK:
    """ids [T, K] int64 and logp [T, K] float32: the engine's top-K per row (0 where ``have`` is False);
    have [T] bool: rows whose sample came with the engine's top-K; kl [T] float64, filled by scoring."""

    ids: torch.Tensor
    logp: torch.Tensor
    have: torch.Tensor
    kl: torch.Tensor


def engine_top_k(samples: list[Sample], k: int, device: torch.device) -> EngineTopK | None:
    """The samples' engine top-K in flat row order on ``device``; None when ``k`` is 0 (off)."""
    if k <= 0:
        return None
    n = [len(s.response_ids) for s in samples]
    t = sum(n)
    ids = torch.zeros(t, k, dtype=torch.long)
    logp = torch.zeros(t, k, dtype=torch.float32)
    have = torch.zeros(t, dtype=torch.bool)
    start = 0
    for s, rows in zip(samples, n, strict=True):
        if s.engine_top_ids is not None and s.engine_top_logp is not None:
            got = (tuple(s.engine_top_ids.shape), tuple(s.engine_top_logp.shape))
            if got != ((rows, k), (rows, k)):
                raise ValueError(
                    f"sample {s.uid or (s.group, s.member)} has engine top-K ids/log-probs of shapes "
                    f"{got} for {rows} response tokens and rollout.parity_top_k={k}; the engine must report "
                    "K entries per response token (SGLang top_logprobs_num)"
                )
            ids[start : start + rows] = s.engine_top_ids
            logp[start : start + rows] = s.engine_top_logp
            # the engine's own tokens only: a multi-turn sample's tool/user tokens were never sampled
            have[start : start + rows] = torch.tensor(assistant_rows(s), dtype=torch.bool)
        start += rows
    kl = torch.zeros(t, dtype=torch.float64)
    return EngineTopK(ids.to(device), logp.to(device), have.to(device), kl.to(device))


def parity_stats(top: EngineTopK | None) -> StepStats:
    """``topk_kl_sum`` / ``topk_kl_max`` / ``topk_kl_tokens`` over the rows with the engine's top-K."""
    if top is None or not bool(top.have.any()):
        return StepStats()
    kl = top.kl[top.have]
    return StepStats(
        topk_kl_sum=float(kl.sum()), topk_kl_max=float(kl.max()), topk_kl_tokens=float(kl.numel())
    )
