"""Trainer-vs-engine parity over the engine's top-K tokens: a stricter oracle than the sampled-token gap.

The sampled-token gap (``logprob/gap_*``: |log π_old(y_t) − log π_rollout(y_t)|) looks at one token per
position. With ``rollout.parity_top_k`` = K the engine also reports its K most likely ids per position and
their log-probs p_1..p_K (SGLang ``top_logprobs_num``; the CPU engine computes the same); the scoring pass
takes the trainer's log-probs q_1..q_K at those ids and this module gives, per token,

    KL_K(p‖q) = Σ_{k≤K} p_k (log p_k − log q_k) + p_tail (log p_tail − log q_tail),
    p_tail = 1 − Σ_k p_k,  q_tail = 1 − Σ_k q_k,

the KL between the two (K+1)-bucket distributions (the K ids, and one bucket for every other token).
Why the tail bucket and not renormalising over the K ids: renormalised, a trainer that scales every one of
the K probabilities by the same factor (mass moved to or from the rest of the vocabulary) reads 0; with
the tail bucket KL_K is 0 if and only if p_k = q_k for every k (the tails are then equal too). It is also
a lower bound on the full-vocabulary KL(engine‖trainer): merging tokens into one bucket can only lower a
KL (the log-sum inequality). Tails are floored at 1e-30 (K ids holding all the mass, or rounding), as the
SDPO tail bucket is (``ops.vocab_parallel.append_tail``).
"""

from __future__ import annotations

import torch

MIN_TAIL = 1e-30


def _tail(logp: torch.Tensor) -> torch.Tensor:
    """[T] log(1 − Σ_K exp(logp)) of [T, K] log-probs, floored at ``MIN_TAIL``."""
    return (-torch.expm1(torch.logsumexp(logp, dim=-1))).clamp_min(MIN_TAIL).log()


def topk_parity_kl(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(engine‖trainer) over the engine's top-K ids plus a tail bucket (module docstring).

    engine_logp: [T, K] the engine's log-probs at its top-K ids; trainer_logp: [T, K] the trainer's
    log-probs at the same ids, same order. Returns [T] float64, ≥ 0 up to rounding, exactly 0 where the
    two are equal.
    """
    if engine_logp.shape != trainer_logp.shape or engine_logp.dim() != 2:
        raise ValueError(
            f"topk_parity_kl needs [T, K] engine and trainer log-probs of one shape; got "
            f"{tuple(engine_logp.shape)} and {tuple(trainer_logp.shape)}"
        )
    lp, lq = engine_logp.double(), trainer_logp.double()
    p = lp.exp()
    head = (p * (lp - lq)).sum(dim=-1)
    tp, tq = _tail(lp), _tail(lq)
    return head + tp.exp() * (tp - tq)
