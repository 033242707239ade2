"""SDPO token loss over top-K + tail buckets and entropy-aware dynamic weights (method §2).

Student P and teacher Q are represented on the K+1 buckets "each of the student's top-K ids" plus
"everything else" (the tail, log(1 − Σ_K p)); this is an exact coarsening of both full distributions.
Divergences are per token ``[T]``; the router applies masks, weights and the global denominator.

Note on the endpoints: method §2 defines α = 0 as KL(Q‖P) ("forward") and α = 1 as KL(P‖Q) ("reverse");
these are special-cased (the generalized-JSD formula itself vanishes at both ends).
"""

from __future__ import annotations

import math

import torch

from srpo_megatron.losses.grpo import LOG_RATIO_CLAMP, importance_weight
from srpo_megatron.ops.vocab_parallel import append_tail

# log-probs are floored here so that 0·log 0 terms (p = 0 buckets) stay finite in value and gradient.
_LOG_FLOOR = -1e30


def _kl(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) = Σ a (log a − log b) over the last dim."""
    return (logp_a.exp() * (logp_a - logp_b)).sum(dim=-1)


def topk_divergence(
    student_topk_logp: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    alpha: float = 0.5,
    add_tail: bool = True,
) -> torch.Tensor:
    """Divergence between student P and teacher Q on the buckets: [T, K] (or [T, K+1]) → [T].

    ``add_tail=True``: inputs are top-K log-probs [T, K] and the tail bucket is appended to each;
    ``add_tail=False``: inputs already hold all buckets (e.g. [T, K+1] with the tail last).
    α = 0: KL(Q‖P); α = 1: KL(P‖Q); otherwise M = (1−α)P + αQ, D = (1−α)·KL(P‖M) + α·KL(Q‖M).
    Gradients flow to the student only (the teacher is detached).
    """
    p = student_topk_logp
    q = teacher_topk_logp.detach()
    if add_tail:
        p, q = append_tail(p), append_tail(q)
    if p.shape != q.shape:
        raise ValueError(f"student buckets {tuple(p.shape)} and teacher buckets {tuple(q.shape)} differ")
    p = p.clamp_min(_LOG_FLOOR)
    q = q.clamp_min(_LOG_FLOOR)
    if alpha == 0.0:
        return _kl(q, p)
    if alpha == 1.0:
        return _kl(p, q)
    log_m = torch.logaddexp(p + math.log1p(-alpha), q + math.log(alpha))
    return (1.0 - alpha) * _kl(p, log_m) + alpha * _kl(q, log_m)


def sdpo_token_loss(
    student_buckets: torch.Tensor,
    teacher_buckets: torch.Tensor,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None = None,
    *,
    alpha: float = 0.5,
    ratio_cap: float = 2.0,
    tis_cap: float | None = 2.0,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token SDPO loss [T] = D(P‖Q buckets) × min(ρ_t, ratio_cap) × w_TIS (both factors detached).

    student_buckets: [T, K+1] student log-probs at the top-K ids plus tail (differentiable)
    teacher_buckets: [T, K+1] teacher log-probs at the same ids plus tail (constant)
    logp, old_logp:  [T] log π_θ(y_t), log π_old(y_t) of the sampled token (for the ratio ρ_t)
    rollout_logp:    [T] engine log-probs for the truncated IS weight (optional)
    is_weight:       [T] a precomputed detached importance weight used instead of TIS (MIS / IcePop);
                     give it or ``rollout_logp``, not both
    """
    div = topk_divergence(student_buckets, teacher_buckets, alpha, add_tail=False)
    log_ratio = (logp.detach() - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # as SDPO's code
    ratio = log_ratio.exp().clamp(max=ratio_cap)
    loss = div * ratio
    metrics = {"divergence": div.detach()}
    w = importance_weight(old_logp, rollout_logp, tis_cap, is_weight)
    if w is not None:
        loss = loss * w
    return loss, metrics


def raw_weights(teacher_entropy: torch.Tensor, beta: float) -> torch.Tensor:
    """w̃ = exp(−β·H) per token: [T] → [T] (constant)."""
    return torch.exp(-beta * teacher_entropy.detach())


def dynamic_weights(
    teacher_entropy: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    mean_raw: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """w = w̃ / mean_Ω(w̃) per token: [T] → [T] (constant; 0 outside ``mask``).

    ``mean_raw`` is the mean of w̃ over Ω_sdpo; pass the global one (Σw̃ / |Ω| from ``global_normalizers``)
    for batch scope. ``None`` takes the mean over ``mask`` here (micro-batch scope).
    """
    w_raw = torch.where(mask, raw_weights(teacher_entropy, beta), 0.0)
    if mean_raw is None:
        count = mask.sum()
        mean_raw = w_raw.sum() / count.clamp_min(1)
    return w_raw / mean_raw
