"""``StepStats``: what one rank measured in one training step, and the one rule that combines them.

Every field declares how it reduces (``sum`` or ``max``) next to its definition; ``reduce_stats`` applies
that rule, over a rank's mini-batches (the learning pass) and over ranks (``step_metrics``). Sum fields
are counted once per data-parallel rank: ranks that hold a copy of the same value (TP ranks other than 0,
pipeline stages without logits) report them as 0 (``counted_once``). Max fields may be reported by every
rank (identical values, or phase times where the slowest rank is the step's time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

SUM, MAX = "sum", "max"


def _stat(reduce: str):
    return field(default=0.0, metadata={"reduce": reduce})


@dataclass
class StepStats:
    """Loss sums over tokens (divide by the matching ``*_tokens`` count), counts, maxima and phase times."""

    loss: float = _stat(SUM)  # Σ of the routed losses (each micro-batch's share of L)
    tokens: float = _stat(SUM)  # valid response tokens
    grpo_tokens: float = _stat(SUM)  # tokens routed to the GRPO loss
    sdpo_tokens: float = _stat(SUM)  # tokens routed to the SDPO loss
    grpo_loss_sum: float = _stat(SUM)  # Σ per-token GRPO loss
    grpo_clipped_sum: float = _stat(SUM)  # GRPO tokens whose ratio was clipped
    sdpo_loss_sum: float = _stat(SUM)  # Σ per-token (weighted) SDPO loss
    divergence_sum: float = _stat(SUM)  # Σ per-token top-K divergence
    raw_weight_sum: float = _stat(SUM)  # Σ w̃ = exp(−β·H) over SDPO tokens
    teacher_entropy_sum: float = _stat(SUM)  # Σ teacher entropy over SDPO tokens
    rollout_logp_gap_sum: float = _stat(SUM)  # Σ |log π_old − log π_rollout|
    rollout_logp_gap_max: float = _stat(MAX)  # max |log π_old − log π_rollout|
    w_tilde_sum: float = _stat(SUM)  # Σ w̃ over this rank's SDPO tokens (logged mean)
    w_tilde_sq_sum: float = _stat(SUM)  # Σ w̃² (logged spread)
    teacher_runs: float = _stat(SUM)  # samples the teacher forward scored
    grad_norm_sum: float = _stat(SUM)  # Σ grad norm over optimizer steps (mean = / optimizer_steps)
    optimizer_steps: float = _stat(SUM)  # optimizer steps taken or skipped
    skipped: float = _stat(MAX)  # 1 if any optimizer step was skipped (non-finite)
    lr: float = _stat(MAX)  # learning rate of the step
    score_s: float = _stat(MAX)  # scoring pass (student), seconds
    teacher_s: float = _stat(MAX)  # teacher scoring, seconds
    train_s: float = _stat(MAX)  # training pass (all mini-batches), seconds
    # MoE routing metrics of the scoring pass (trainer/moe_routing.py): already reduced over all ranks, so
    # every rank reports the same value (MAX). moe = 1 marks an MoE policy, moe_compared = 1 that the
    # engine reported experts (the two top-k shares are only defined then).
    moe: float = _stat(MAX)  # 1 for an MoE policy
    moe_expert_load: float = _stat(MAX)  # worst layer's max/mean tokens per expert
    moe_router_entropy: float = _stat(MAX)  # mean per-token router entropy (nats)
    moe_compared: float = _stat(MAX)  # 1 when engine top-k was compared
    moe_topk_mismatch: float = _stat(MAX)  # share of (response token, layer) whose used top-k != engine's
    moe_router_disagreement: float = _stat(MAX)  # same for the trainer's own top-k (before replay)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, object], **extra: float) -> StepStats:
        """From ``routed_loss``'s metrics (0-dim tensors named like the fields) plus ``extra`` fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(metrics) - names)
        if unknown:
            raise KeyError(f"routed_loss metrics {unknown} have no StepStats field; add them to StepStats")
        return cls(**{k: float(v) for k, v in metrics.items()}, **extra)  # type: ignore[arg-type]

    @classmethod
    def from_moe(cls, summary: Mapping[str, float]) -> StepStats:
        """From ``RouterRecorder.summary``'s figures."""
        compared = "moe/topk_mismatch_share" in summary
        return cls(
            moe=1.0,
            moe_expert_load=summary["moe/expert_load_max_over_mean"],
            moe_router_entropy=summary["moe/router_entropy"],
            moe_compared=float(compared),
            moe_topk_mismatch=summary.get("moe/topk_mismatch_share", 0.0),
            moe_router_disagreement=summary.get("moe/router_disagreement_share", 0.0),
        )

    def counted_once(self, counted: bool) -> StepStats:
        """Zero the sum fields on a rank whose values another rank already counts."""
        if counted:
            return self
        return dataclasses.replace(
            self, **{f.name: 0.0 for f in dataclasses.fields(self) if f.metadata["reduce"] == SUM}
        )


def reduce_stats(items: Iterable[StepStats]) -> StepStats:
    """Combine stats field by field with each field's declared reduction (the empty reduction is 0)."""
    out = StepStats()
    for item in items:
        for f in dataclasses.fields(StepStats):
            a, b = getattr(out, f.name), getattr(item, f.name)
            setattr(out, f.name, a + b if f.metadata["reduce"] == SUM else max(a, b))
    return out
