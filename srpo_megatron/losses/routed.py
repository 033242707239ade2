"""The routed SRPO objective (method §2 "Final objective") for one micro-batch of tokens.

    L = ( Σ_{i,t} z_i^GRPO ℓ^GRPO_{i,t} + Σ_{i,t} z_i^SDPO w_{i,t} ℓ^SDPO_{i,t} ) / N_tokens

``routed_loss`` returns this micro-batch's share of L: its per-token sum divided by the *global*
denominator N_tokens, which the caller supplies (``global_normalizers`` all-reduces it, together with
Σ w̃ and |Ω_sdpo| for the dynamic weights, over the data-parallel group before the training pass).
Summing the returned losses over micro-batches and DP ranks gives L exactly, so L and its gradient do
not depend on the micro-batch size, the DP size, or the TP size (all TP ranks return the same value).
The trainer must therefore *sum* (not average) gradients over micro-batches and DP ranks.

``loss.aggregation: seq_mean_token_mean`` (SDPO's and verl's code, the paper's baseline runs) replaces
N_tokens by a per-sequence mean, (1/N_seq) Σ_i (1/|y_i|) Σ_t, with the same invariances: every branch's
token loss (GRPO with its KL and entropy terms, weighted SDPO) is multiplied by its sample's 1/|y_i|
(``TokenBatch.seq_weight``) and the sum divided by the global N_seq (``losses/aggregation.py``). The dynamic
weights' mean over Ω_sdpo stays a token mean in both modes.

Batch layout: flat per-token tensors. Row t is one token position of a response (packed across
samples, padding allowed with ``mask`` False); per-sample fields (advantage, route) are broadcast to
the sample's rows. ``student_logits`` row t predicts ``response_ids[t]``.

Modes (``LossConfig.mode``) are encoded in the batch's ``grpo`` / ``sdpo`` row masks (built with
``routing_masks``) plus two switches here: dynamic weights only in ``srpo``; ``advantage_mix`` replaces
the GRPO advantage by λ·A_GRPO + (1 − λ)·A_SDPO.

Deviation / interpretation: The paper names the ``advantage_mix`` ablation without defining A_SDPO. Here it is
SDPO's per-token self-distillation advantage A_SDPO = log q(y_t) − log π_old(y_t) (teacher vs. student
log-prob of the sampled token; 0 for samples without a teacher), applied through the same clipped GRPO
surrogate. In ``sdpo`` mode (and ``sdpo_incorrect_only`` / ``sdpo_correct_only``), samples without an
SDPO route contribute no loss but their tokens still count in N_tokens (same denominator for every mode).

Off-policy corrections (``loss.is_correction``, ``loss.mask_stale_tokens``; ``losses/importance.py``):
the detached weight of each token's policy-gradient term is TIS (default), MIS or IcePop; tokens that MIS
or the stale mask reject take no loss; stale ones, and MIS-rejected ones under
``loss.is_rejection_denominator: drop``, are cleared from ``mask`` once after scoring
(``apply_rejections``), so they are not in N_tokens, |Ω_sdpo| or Σ w̃; under ``keep`` MIS-rejected tokens
stay in ``mask`` and in every count (slime's and miles' rule) and ``loss_rows`` leaves them out of the sums;
IcePop's zero-weight tokens stay in N_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from srpo_megatron.config import LossConfig
from srpo_megatron.losses.aggregation import aggregate, sequence_count
from srpo_megatron.losses.batch import Normalizers, TokenBatch
from srpo_megatron.losses.grpo import grpo_token_loss
from srpo_megatron.losses.importance import bounded_is_weight, check_rejections, loss_rows
from srpo_megatron.losses.sdpo import dynamic_weights, raw_weights, sdpo_token_loss
from srpo_megatron.ops.fused_output import OutputShard
from srpo_megatron.ops.vocab_parallel import VocabStats, append_tail, token_stats


def _sdpo_rows(batch: TokenBatch) -> torch.Tensor:
    return batch.sdpo & batch.mask


# The modes that route some samples to the GRPO loss (``losses/routing.py`` ``routing_masks``).
GRPO_MODES = ("srpo", "srpo_no_dw", "grpo", "advantage_mix")


def global_normalizers(
    micro_batches: Sequence[TokenBatch], beta: float, group: dist.ProcessGroup | None = None
) -> Normalizers:
    """Sum token count, |Ω_sdpo|, Σ w̃ and N_seq over ``micro_batches`` and all-reduce them over the DP
    ``group``. N_seq (Σ of ``seq_weight`` over the valid rows, rounded: each sample's weights sum to 1) is 0
    when the micro-batches carry no ``seq_weight`` (``token_mean``).

    Call once per optimizer step, after the scoring pass, on every rank (a collective when ``group`` is set).
    """
    device = micro_batches[0].mask.device if micro_batches else None
    # [tokens, |Ω_sdpo|, Σ w̃, N_seq, SDPO tokens without teacher_entropy]: read in one host sync
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for mb in micro_batches:
        sums[0] += mb.mask.sum()
        sums[3] += sequence_count(mb)
        rows = _sdpo_rows(mb)
        if mb.teacher_entropy is None:
            sums[4] += rows.sum()
        else:  # no rows: adds exactly 0
            sums[1] += rows.sum()
            sums[2] += raw_weights(mb.teacher_entropy[rows].double(), beta).sum()
    if group is not None:
        dist.all_reduce(sums, group=group)
    sums[3] = sums[3].round()
    tokens, sdpo, weights, seqs, untaught = sums.tolist()
    if untaught:
        raise ValueError("a micro-batch has SDPO tokens but no teacher_entropy (run score_teacher first)")
    return Normalizers(tokens, sdpo, weights, seqs)


def routed_loss(
    student_logits: torch.Tensor | OutputShard,
    batch: TokenBatch,
    normalizers: Normalizers,
    cfg: LossConfig,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of L, and metrics.

    student_logits: [T, V/P] logits shard of the tensor-parallel ``group`` (None = whole vocabulary), or
                    the output layer unapplied (``ops.fused_output.OutputShard``)
    Returns (loss scalar = Σ_t per-token loss / normalizers.num_tokens, or under ``seq_mean_token_mean``
    Σ_t seq_weight_t · per-token loss / normalizers.num_seqs (``losses/aggregation.py``), metrics). Metrics
    are detached
    sums over this micro-batch's valid tokens (sum them over micro-batches and DP ranks, then divide by
    the matching ``*_tokens`` count), except ``*_max`` entries (reduce with max).
    """
    if normalizers.num_tokens <= 0:
        raise ValueError("normalizers.num_tokens is 0: the batch has no valid response tokens")
    check_rejections(batch, cfg)
    # rows that take loss: the mask, less the MIS-rejected rows loss.is_rejection_denominator: keep leaves in
    # it for the denominators (the SDPO rows below stay the mask's, as |Ω_sdpo|; a rejected row's weight is 0)
    mask = loss_rows(batch, cfg)
    sdpo_rows = _sdpo_rows(batch).nonzero().squeeze(1)
    grpo_rows = batch.grpo & mask
    # Decided by the mode, not by the rows (no host sync): a micro-batch with no GRPO row computes the
    # branch on no rows, which adds exactly 0 to the loss and to the metrics' sums.
    need_grpo = cfg.mode in GRPO_MODES
    stats = _student_stats(student_logits, batch, sdpo_rows, need_grpo, cfg, group)
    logp = stats.logp[:, 0]
    per_token = torch.zeros_like(logp)
    metrics: dict[str, torch.Tensor] = {}
    # TIS stays inside the token losses (the paper's path, bit for bit); MIS / IcePop pass their weight.
    tis = cfg.is_correction == "tis"
    rollout_logp = batch.rollout_logp if tis else None
    is_w = None if tis else bounded_is_weight(batch.old_logp, batch.rollout_logp, batch.seq_log_ratio, cfg)
    if is_w is not None:  # IcePop's ratios outside the bounds (w > 0 inside, since is_low > 0)
        metrics["is_zeroed_tokens"] = _count((is_w == 0) & mask)
    weights = _TokenWeights(rollout_logp, is_w)
    if need_grpo:
        loss_g = _grpo_branch(stats, batch, grpo_rows, weights, cfg, metrics)
        per_token = torch.where(grpo_rows, loss_g, per_token)
    if sdpo_rows.numel():
        loss_s = _sdpo_branch(stats, batch, sdpo_rows, weights, normalizers, cfg, metrics)
        per_token = per_token.index_add(0, sdpo_rows, loss_s)
    if mask is not batch.mask:  # keep: no SDPO term on a rejected row either
        per_token = torch.where(mask, per_token, 0.0)
    loss = aggregate(per_token, batch, normalizers, cfg.aggregation)
    if not need_grpo and not sdpo_rows.numel():
        # Nothing routed here (e.g. pure SDPO, no sample has a teacher): keep the loss attached to the
        # graph with an exactly-zero gradient, so backward and DDP hooks still run on this micro-batch.
        loss = loss + 0.0 * logp.sum()
    metrics["tokens"] = _count(mask)
    if batch.rollout_logp is not None:  # no valid row: a sum of 0 and a max of 0, the stats' defaults
        gap = (batch.old_logp - batch.rollout_logp).abs()[mask].double()
        metrics["rollout_logp_gap_sum"] = gap.sum()
        metrics["rollout_logp_gap_max"] = torch.cat([gap, gap.new_zeros(1)]).max()  # |·| >= 0
    return loss, metrics


def _count(rows: torch.Tensor) -> torch.Tensor:
    return rows.sum().to(torch.float64)


@dataclass(frozen=True)
class _TokenWeights:
    """The detached off-policy weight of each token's policy-gradient term: TIS from ``rollout_logp``
    inside the token losses, or the precomputed MIS / IcePop ``is_weight`` (one of them, or neither)."""

    rollout_logp: torch.Tensor | None
    is_weight: torch.Tensor | None

    def rows(self, index: torch.Tensor) -> _TokenWeights:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return _TokenWeights(pick(self.rollout_logp), pick(self.is_weight))


def _student_stats(
    student_logits: torch.Tensor | OutputShard,
    batch: TokenBatch,
    sdpo_rows: torch.Tensor,
    need_grpo: bool,
    cfg: LossConfig,
    group: dist.ProcessGroup | None,
) -> VocabStats:
    """The student's log-probs at the sampled token (column 0) and, on SDPO rows, at the top-K ids; the
    entropy only where the GRPO entropy bonus needs it."""
    ids = batch.response_ids.reshape(-1, 1)
    if sdpo_rows.numel():
        if batch.topk_ids is None or batch.teacher_logp is None:
            raise ValueError("SDPO tokens need topk_ids and teacher_logp (score_student / score_teacher)")
        ids = torch.cat([ids, batch.topk_ids], dim=1)
    return token_stats(
        student_logits,
        ids,
        with_entropy=need_grpo and cfg.entropy_coef != 0.0,
        group=group,
        temperature=cfg.temperature,
        chunk_tokens=cfg.chunk_tokens or None,
    )


def _grpo_branch(
    stats: VocabStats,
    batch: TokenBatch,
    grpo_rows: torch.Tensor,
    weights: _TokenWeights,
    cfg: LossConfig,
    metrics: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The GRPO token loss [T] (read on ``grpo_rows`` only), its metrics added to ``metrics``."""
    logp = stats.logp[:, 0]
    adv = batch.advantages.to(logp.dtype)
    if cfg.mode == "advantage_mix":
        if batch.teacher_token_logp is None or batch.teacher is None:
            raise ValueError(
                "advantage_mix needs teacher_token_logp and teacher (score_teacher(response_ids=...))"
            )
        a_sdpo = torch.where(batch.teacher, batch.teacher_token_logp - batch.old_logp, 0.0)
        adv = cfg.adv_mix_lambda * adv + (1.0 - cfg.adv_mix_lambda) * a_sdpo
    loss_g, mg = grpo_token_loss(
        logp,
        batch.old_logp,
        adv,
        weights.rollout_logp,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        dual_clip=cfg.dual_clip,
        tis_cap=cfg.tis_cap,
        ref_logp=batch.ref_logp,
        kl_coef=cfg.kl_coef,
        entropy=stats.entropy if stats.entropy.numel() else None,
        entropy_coef=cfg.entropy_coef,
        is_weight=weights.is_weight,
    )
    metrics["grpo_tokens"] = _count(grpo_rows)
    metrics["grpo_loss_sum"] = loss_g.detach()[grpo_rows].double().sum()
    metrics["grpo_clipped_sum"] = mg["clipped"][grpo_rows].double().sum()
    return loss_g


def _sdpo_branch(
    stats: VocabStats,
    batch: TokenBatch,
    sdpo_rows: torch.Tensor,
    weights: _TokenWeights,
    normalizers: Normalizers,
    cfg: LossConfig,
    metrics: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The (dynamically weighted) SDPO token loss on ``sdpo_rows`` ([R], in their order), its metrics
    added to ``metrics``."""
    assert batch.teacher_logp is not None  # checked by _student_stats
    logp = stats.logp[:, 0]
    student_buckets = append_tail(stats.logp[sdpo_rows, 1:])
    w_rows = weights.rows(sdpo_rows)
    loss_s, ms = sdpo_token_loss(
        student_buckets,
        batch.teacher_logp[sdpo_rows],
        logp[sdpo_rows],
        batch.old_logp[sdpo_rows],
        w_rows.rollout_logp,
        alpha=cfg.divergence_alpha,
        ratio_cap=cfg.sdpo_ratio_cap,
        tis_cap=cfg.tis_cap,
        is_weight=w_rows.is_weight,
    )
    if cfg.uses_dynamic_weights:
        if batch.teacher_entropy is None:
            raise ValueError("dynamic SDPO weights need teacher_entropy (run score_teacher first)")
        ent = batch.teacher_entropy[sdpo_rows]
        all_rows = torch.ones_like(ent, dtype=torch.bool)
        mean = normalizers.mean_raw_weight if cfg.weight_scope == "batch" else None
        loss_s = loss_s * dynamic_weights(ent, all_rows, cfg.beta, mean).to(loss_s.dtype)
    if batch.teacher_entropy is not None:
        # Logged in every SDPO mode (not only where they weight the loss): Fig. 1(c)'s entropy curve and
        # the entropy weight w̃ = exp(−β·H) (its mean and spread), in float64.
        ent64 = batch.teacher_entropy[sdpo_rows].double()
        w_raw = raw_weights(ent64, cfg.beta)
        metrics["teacher_entropy_sum"] = ent64.sum()
        metrics["raw_weight_sum"] = w_raw.sum()
        metrics["raw_weight_sq_sum"] = (w_raw**2).sum()
    metrics["sdpo_tokens"] = torch.full((), float(sdpo_rows.numel()), dtype=torch.float64, device=logp.device)
    metrics["sdpo_loss_sum"] = loss_s.detach().double().sum()
    metrics["divergence_sum"] = ms["divergence"].double().sum()
    return loss_s
