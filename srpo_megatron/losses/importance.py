"""Off-policy corrections: the behaviour-policy ratio ρ = π_old / π_rollout, per token or per sequence.

π_old is the trainer's log-prob at scoring time, π_rollout the engine's (the weights that generated the
token, up to ``rollout.off_policy_steps`` versions older; with partial rollouts each token's own
version). Every weight is detached: it changes the measure, not the objective. ``loss.is_correction``:

- ``tis`` (the paper's; default): w_t = min(ρ_t, tis_cap) on every token (``grpo.tis_weight``).
- ``mis``, masked importance sampling (verl's rollout correction ``rollout_is_mode: mask`` /
  rejection sampling, ``verl/trainer/ppo/rollout_corr_helper.py``; slime's
  ``examples/train_infer_mismatch_helper/mis.py`` ``mis_mode: mask``; "When Speed Kills Stability",
  Liu, Li et al. 2025): the ratio is tested against [is_low, is_high]; inside, w = ρ (unclamped); outside,
  the token is rejected — removed from the loss *and* from N_tokens, as verl and slime remove it from the
  response mask that their loss aggregation divides by. ``is_level: token`` tests ρ_t per token;
  ``is_level: sequence`` tests the product ρ_i = exp(Σ_t log ρ_t) over the sample's response tokens
  (verl's and slime's ``sequence`` level: the product, not the geometric mean), and keeps or rejects the
  whole sequence, every token weighted by ρ_i.
- ``icepop`` (Ring-1T, "Every Step Evolves", arXiv 2510.18855, §IcePop): w_t = M(ρ_t) with M(k) = k if
  is_low <= k <= is_high else 0 (two-sided, the paper's α = 0.5, β = 5); a zeroed token stays in N_tokens,
  as M multiplies the token's term inside the paper's per-sequence mean (verl's IcePop likewise zeroes the
  weight and leaves the response mask alone).

``loss.mask_stale_tokens`` rejects, like MIS, every token generated more than ``rollout.off_policy_steps``
versions before the trainer's weights (``TokenBatch.stale``): no loss and not in N_tokens, as if the
token had not been sampled — the treatment verl's fully-async trainer and this project's scheduler give a
whole sample that is too stale (dropped). At N = 0 nothing is stale, so either choice of denominator
leaves the on-policy objective unchanged.

Rejections are applied once per rollout batch, after the scoring pass (``apply_rejections``), by clearing
``TokenBatch.mask``: every denominator (N_tokens, |Ω_sdpo|, Σ w̃) and every row mask then agrees, and
``global_normalizers`` needs no configuration. ``routed_loss`` refuses a batch that still holds a token
this configuration rejects (``check_rejections``). Weights multiply the policy-gradient term (the clipped
GRPO surrogate, the SDPO token loss), not the KL or entropy terms, as TIS does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from srpo_megatron.config import LossConfig

if TYPE_CHECKING:
    from srpo_megatron.losses.batch import TokenBatch


def sequence_log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, offsets: Sequence[int]
) -> torch.Tensor:
    """log ρ_i = Σ_t (log π_old − log π_rollout) over each sample's valid rows, broadcast: [T] → [T].

    ``offsets``: N + 1 host ints; sample i owns rows ``[offsets[i], offsets[i + 1])``.
    """
    dev, n = old_logp.device, len(offsets) - 1
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(offsets)], dtype=torch.long, device=dev)
    sample = torch.repeat_interleave(torch.arange(n, device=dev), lengths)
    diff = torch.where(mask, old_logp.detach() - rollout_logp.detach(), 0.0)
    sums = torch.zeros(n, dtype=diff.dtype, device=dev).index_add(0, sample, diff)
    return sums[sample]


def _log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, seq_log_ratio: torch.Tensor | None, cfg: LossConfig
) -> torch.Tensor:
    """[T] the log-ratio the bounds test: per token, or the row's sequence (``is_level: sequence``)."""
    if cfg.is_level == "sequence":
        if seq_log_ratio is None:
            raise ValueError(
                "loss.is_level: sequence needs TokenBatch.seq_log_ratio (apply_rejections after scoring)"
            )
        return seq_log_ratio.detach()
    return old_logp.detach() - rollout_logp.detach()


def outside_bounds(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    seq_log_ratio: torch.Tensor | None,
    cfg: LossConfig,
) -> torch.Tensor | None:
    """[T] bool: ρ outside [is_low, is_high] (mis / icepop); None for tis or without engine log-probs."""
    if cfg.is_correction == "tis" or rollout_logp is None:
        return None
    rho = _log_ratio(old_logp, rollout_logp, seq_log_ratio, cfg).exp()
    return ~((rho >= cfg.is_low) & (rho <= cfg.is_high))  # NaN counts as outside


def bounded_is_weight(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    seq_log_ratio: torch.Tensor | None,
    cfg: LossConfig,
) -> torch.Tensor | None:
    """[T] detached w = ρ inside [is_low, is_high], 0 outside (mis / icepop); None for tis (the token
    losses apply TIS themselves, as before) or without engine log-probs.

    Outside rows get an exact 0, never ρ: ρ may overflow there, and inf · 0 would put NaN in the gradient.
    """
    outside = outside_bounds(old_logp, rollout_logp, seq_log_ratio, cfg)
    if outside is None:
        return None
    assert rollout_logp is not None
    rho = _log_ratio(old_logp, rollout_logp, seq_log_ratio, cfg).exp()
    return torch.where(outside, 0.0, rho)


def rejected_rows(batch: TokenBatch, cfg: LossConfig) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(stale [T] bool, IS-rejected [T] bool) among the valid rows; None where the configuration rejects
    nothing of that kind."""
    stale = None
    if cfg.mask_stale_tokens:
        if batch.stale is None:
            raise ValueError(
                "loss.mask_stale_tokens needs each token's staleness (TokenBatch.stale): pass the trainer's "
                "weight version to score_rollouts(..., trainer_version=...)"
            )
        stale = batch.stale & batch.mask
    rejected = None
    if cfg.is_correction == "mis":
        outside = outside_bounds(batch.old_logp, batch.rollout_logp, batch.seq_log_ratio, cfg)
        rejected = None if outside is None else outside & batch.mask
    return stale, rejected


def apply_rejections(batch: TokenBatch, cfg: LossConfig, offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """In place, once per rollout batch after the scoring pass (π_old known on every row): fill
    ``seq_log_ratio`` for sequence-level MIS and clear ``mask`` at the rows the correction rejects.

    Returns 0-dim float64 counts over the valid rows: ``rejected_tokens`` (all rows cleared) and
    ``stale_tokens`` (of those, the stale ones).
    """
    if cfg.is_correction == "mis" and cfg.is_level == "sequence" and batch.rollout_logp is not None:
        batch.seq_log_ratio = sequence_log_ratio(batch.old_logp, batch.rollout_logp, batch.mask, offsets)
    stale, rejected = rejected_rows(batch, cfg)
    drop = torch.zeros_like(batch.mask)
    for part in (stale, rejected):
        if part is not None:
            drop = drop | part
    batch.mask = batch.mask & ~drop
    count = lambda m: m.sum().to(torch.float64)  # noqa: E731
    return {
        "rejected_tokens": count(drop),
        "stale_tokens": count(torch.zeros_like(drop) if stale is None else stale),
    }


def check_rejections(batch: TokenBatch, cfg: LossConfig) -> None:
    """Refuse a batch whose ``mask`` still holds a token ``cfg`` rejects (``apply_rejections`` not run):
    its denominators would count tokens the loss drops."""
    if not cfg.rejects_tokens:
        return
    stale, rejected = rejected_rows(batch, cfg)
    for part, what in (
        (stale, "stale tokens (loss.mask_stale_tokens)"),
        (rejected, "tokens whose ratio lies outside [loss.is_low, loss.is_high] (loss.is_correction: mis)"),
    ):
        if part is not None and bool(part.any()):
            raise ValueError(
                f"the batch's mask still holds {what}, which the loss rejects, so the token counts would "
                "include them; run losses.apply_rejections once after the scoring pass, before "
                "global_normalizers"
            )
