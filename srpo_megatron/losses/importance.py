"""Off-policy corrections: the behaviour-policy ratio ρ = π_old / π_rollout, per token or per sequence.

π_old is the trainer's log-prob at scoring time, π_rollout the engine's (the weights that generated the
token, up to ``rollout.off_policy_steps`` versions older; with partial rollouts each token's own
version). Every weight is detached: it changes the measure, not the objective, and is exp of the
log-ratio clamped to ±``IS_LOG_RATIO_CLAMP`` (per token, or the sequence's sum), as verl's
``rollout_corr_helper.py`` and slime's ``mis.py`` do: an engine log-prob of −inf then gives a finite
weight instead of inf (and NaN in the gradient), and a finite log-ratio inside ±20 is unchanged bit for
bit. ``loss.is_correction``:

- ``tis`` (the paper's; default): w_t = min(ρ_t, tis_cap) on every token (``grpo.tis_weight``).
- ``mis``, masked importance sampling ("When Speed Kills Stability", Liu, Li et al. 2025; slime's
  ``examples/train_infer_mismatch_helper/mis.py`` with ``tis_mode: mask``; verl's rejection sampling
  ``rollout_rs: token_k1`` / ``seq_sum_k1`` in ``verl/trainer/ppo/rollout_corr_helper.py``): ρ is tested
  against [is_low, is_high] (inclusive); inside, w = ρ (unclamped); outside, the token is rejected: it
  takes no loss (no policy-gradient, SDPO, KL or entropy term). ``is_level: token`` tests ρ_t per token;
  ``is_level: sequence`` tests the product ρ_i = exp(Σ_t log ρ_t) over the sample's response tokens (the
  product, as slime's and verl's ``sequence`` level, not the geometric mean), and keeps or rejects the
  whole sequence, every token weighted by ρ_i.
  Orientation: slime bounds the same ratio (exp(train − rollout)); verl's ``token_k1`` is
  log(π_rollout/π_old), so its ``rollout_rs_threshold: "a_b"`` keeps a_b ≤ π_rollout/π_old, which is
  ``is_low = 1/b, is_high = 1/a`` here (the default [0.5, 5] is verl's ``"0.2_2.0"``). verl's weight on a
  kept token is its separate ``rollout_is`` truncation: ``rollout_is_threshold >= is_high`` leaves ρ as here.
  ``loss.is_rejection_denominator`` says what a rejected token does to the denominators (N_tokens, |y_i|
  and N_seq of ``loss.aggregation``, |Ω_sdpo| and Σ w̃ of the dynamic weights):
  ``drop`` (default) — it leaves all of them, as if it had not been sampled: verl writes the rejection into
  ``response_mask``, which its ``agg_loss`` divides by; ``keep`` — it stays in all of them, with zero loss:
  slime (``slime/backends/megatron_utils/loss.py``: the rejection masks the numerator, "denominators stay
  the precomputed per-rollout totals") and miles (``miles/backends/training_utils/loss_hub/losses.py``,
  the same rule). Under ``keep`` a heavily rejected batch takes a smaller step; under ``drop`` the loss is
  the mean over the accepted tokens, the rejection-sampling estimator. ``drop`` stays the default: it is
  what this project shipped, it treats a rejected token like a stale one (below), and neither anchor's
  choice is argued in its code. The dynamic weights' |Ω_sdpo| and Σ w̃ (no anchor has them) follow the
  same rule, so every count agrees.
  Not supported from slime's ``mis.py``: the ``geometric`` level (mean log-ratio), ``rs_veto_threshold``
  (reject a sequence holding one token below the threshold), ``tis_batch_normalize`` (weights divided by
  their batch mean), separate rejection bounds (``rs_lower_bound`` / ``rs_upper_bound``) and the ``clip``
  mode; nor verl's k2 / k3 / ``seq_mean`` / ``seq_max`` criteria and ``rollout_is_batch_normalize``.
- ``icepop`` (Ring-1T, "Every Step Evolves", arXiv 2510.18855, §IcePop; slime's ``icepop_function`` in
  ``slime/backends/megatron_utils/loss.py``): w_t = M(ρ_t) with M(k) = k if is_low <= k <= is_high else 0
  (two-sided, the paper's α = 0.5, β = 5, the same ratio as slime's ``tis_clip_low`` / ``tis_clip``); a
  zeroed token stays in N_tokens, as M multiplies the token's term inside the paper's per-sequence mean
  (slime likewise returns the loss mask unchanged). verl has no IcePop.

``loss.mask_stale_tokens`` rejects every token generated more than ``rollout.off_policy_steps`` versions
before the trainer's weights (``TokenBatch.stale``): no loss and not in any denominator (whatever
``is_rejection_denominator`` says), as if the token had not been sampled — the treatment verl's
fully-async trainer and this project's scheduler give a whole sample that is too stale (dropped). At N = 0
nothing is stale. A stale token still counts in the sequence-level ratio ρ_i: ρ_i is the likelihood ratio
of the sequence that was sampled, and the sample's later tokens were generated after the stale ones, so
leaving their factor out would weight the sequence as if its stale prefix came from π_old. Masking a stale
token removes its own gradient term, not its part in how the sequence was drawn.

Rejections are applied once per rollout batch, after the scoring pass (``apply_rejections``), by clearing
``TokenBatch.mask`` at the rows that leave the denominators: every denominator (N_tokens, |Ω_sdpo|, Σ w̃,
|y_i|, N_seq) and every row mask then agrees, and ``global_normalizers`` needs no configuration. Under
``keep`` the MIS-rejected rows stay in ``mask`` and ``routed_loss`` takes its loss over ``loss_rows``
only. ``routed_loss`` refuses a batch whose mask still holds a token that should have left it
(``check_rejections``). Weights multiply the policy-gradient term (the clipped GRPO surrogate, the SDPO
token loss), not the KL or entropy terms, as TIS does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from srpo_megatron.config import LossConfig

if TYPE_CHECKING:
    from srpo_megatron.losses.batch import TokenBatch

# |log ρ| above which ρ is held constant before exp (verl's and slime's SAFETY_BOUND): e^20 ≈ 4.9e8 lies far
# outside any bound or cap, so finite log-ratios inside it give the same weights bit for bit.
IS_LOG_RATIO_CLAMP = 20.0


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a detached log-ratio clamped to ±IS_LOG_RATIO_CLAMP: finite for ±inf inputs (NaN stays NaN)."""
    return log_ratio.detach().clamp(-IS_LOG_RATIO_CLAMP, IS_LOG_RATIO_CLAMP).exp()


def sequence_log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, offsets: Sequence[int]
) -> torch.Tensor:
    """log ρ_i = Σ_t (log π_old − log π_rollout) over each sample's valid rows, broadcast: [T] → [T].

    ``offsets``: N + 1 host ints; sample i owns rows ``[offsets[i], offsets[i + 1])``. ``mask`` is the
    batch's mask before any rejection: stale tokens count (see the module docstring). Unclamped; the
    weight clamps the sum (``clamped_exp``).
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
    rho = clamped_exp(_log_ratio(old_logp, rollout_logp, seq_log_ratio, cfg))
    return ~((rho >= cfg.is_low) & (rho <= cfg.is_high))  # NaN counts as outside


def bounded_is_weight(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    seq_log_ratio: torch.Tensor | None,
    cfg: LossConfig,
) -> torch.Tensor | None:
    """[T] detached w = ρ inside [is_low, is_high], 0 outside (mis / icepop); None for tis (the token
    losses apply TIS themselves, as before) or without engine log-probs.

    Outside rows get an exact 0, never ρ (a NaN ratio counts as outside).
    """
    outside = outside_bounds(old_logp, rollout_logp, seq_log_ratio, cfg)
    if outside is None:
        return None
    assert rollout_logp is not None
    rho = clamped_exp(_log_ratio(old_logp, rollout_logp, seq_log_ratio, cfg))
    return torch.where(outside, 0.0, rho)


def rejected_rows(batch: TokenBatch, cfg: LossConfig) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(stale [T] bool, IS-rejected [T] bool) among the valid rows; None where the configuration rejects
    nothing of that kind."""
    stale = None
    if cfg.mask_stale_tokens:
        if batch.stale is None:
            raise ValueError(
                "loss.mask_stale_tokens needs each token's staleness (TokenBatch.stale): pass the trainer's "
                "weight version to scoring_pass(..., trainer_version=...)"
            )
        stale = batch.stale & batch.mask
    rejected = None
    if cfg.is_correction == "mis":
        outside = outside_bounds(batch.old_logp, batch.rollout_logp, batch.seq_log_ratio, cfg)
        rejected = None if outside is None else outside & batch.mask
    return stale, rejected


def apply_rejections(batch: TokenBatch, cfg: LossConfig, offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """In place, once per rollout batch after the scoring pass (π_old known on every row): fill
    ``seq_log_ratio`` for sequence-level MIS (over the mask before any rejection, stale tokens included)
    and clear ``mask`` at the rejected rows that leave the denominators: the stale ones, and the MIS-rejected
    ones under ``loss.is_rejection_denominator: drop``.

    Returns 0-dim float64 counts over the valid rows: ``rejected_tokens`` (every row that takes no loss,
    whether or not it stays in the denominators) and ``stale_tokens`` (of those, the stale ones).
    """
    if cfg.is_correction == "mis" and cfg.is_level == "sequence" and batch.rollout_logp is not None:
        batch.seq_log_ratio = sequence_log_ratio(batch.old_logp, batch.rollout_logp, batch.mask, offsets)
    stale, rejected = rejected_rows(batch, cfg)
    none = torch.zeros_like(batch.mask)
    stale = none if stale is None else stale
    rejected = none if rejected is None else rejected
    lost = stale | rejected  # rows without loss
    batch.mask = batch.mask & ~(lost if cfg.is_rejection_denominator == "drop" else stale)
    count = lambda m: m.sum().to(torch.float64)  # noqa: E731
    return {
        "rejected_tokens": count(lost),
        "stale_tokens": count(stale),
    }


def loss_rows(batch: TokenBatch, cfg: LossConfig) -> torch.Tensor:
    """[T] bool: the rows that take loss — ``mask`` without the MIS-rejected rows that
    ``is_rejection_denominator: keep`` leaves in it (for the denominators); ``mask`` itself otherwise."""
    if cfg.is_correction != "mis" or cfg.is_rejection_denominator != "keep":
        return batch.mask
    rejected = rejected_rows(batch, cfg)[1]
    return batch.mask if rejected is None else batch.mask & ~rejected


def check_rejections(batch: TokenBatch, cfg: LossConfig) -> None:
    """Refuse a batch whose ``mask`` still holds a token that ``cfg`` takes out of the denominators
    (``apply_rejections`` not run): its denominators would count tokens the loss drops."""
    if not cfg.rejects_tokens:
        return
    stale, rejected = rejected_rows(batch, cfg)
    if cfg.is_rejection_denominator == "keep":
        rejected = None  # they stay in the mask, for the denominators
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
