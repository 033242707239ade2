"""Assemble one step's method §6 metrics on rank 0 from the rollout batch and every rank's ``StepStats``.

The per-rank stats travel over the host (gloo) group as Python objects and are combined with
``reduce_stats``, the same reduction the learning pass uses over mini-batches. Every name is declared, with
its reduction, in ``step_types.METRICS``; ``merge_metrics`` refuses a name the batch already produced.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from srpo_megatron.trainer.observe.stats import reduce_stats
from srpo_megatron.trainer.step_types import RolloutBatch, StepStats, merge_metrics


def gather_stats(stats: StepStats, host_group: Any = None) -> StepStats:
    """Collective over the gloo ``host_group`` (None = default group): all ranks' stats, reduced."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stats
    out: list[Any] = [None] * dist.get_world_size(host_group)
    dist.all_gather_object(out, stats, group=host_group)
    return reduce_stats(out)


def step_metrics(batch: RolloutBatch, s: StepStats, sync_s: float, step_s: float) -> dict[str, float]:
    """The logged metrics of one step from the reduced stats ``s`` of all ranks."""
    tokens = max(s.tokens, 1.0)
    sdpo, grpo = s.sdpo_tokens, s.grpo_tokens
    w_mean = s.raw_weight_sum / max(sdpo, 1.0)
    w_var = s.raw_weight_sq_sum / max(sdpo, 1.0) - w_mean**2
    scored = max(s.tokens + s.rejected_tokens, 1.0)  # every response token, before off-policy rejections
    m = {
        "loss/total": s.loss,
        "loss/grpo": s.grpo_loss_sum / tokens,
        "loss/sdpo": s.sdpo_loss_sum / tokens,
        "loss/grpo_clip_frac": s.grpo_clipped_sum / max(grpo, 1.0),
        "tokens/grpo_frac": grpo / tokens,
        "tokens/sdpo_frac": sdpo / tokens,
        "tokens/total": tokens,
        "teacher/entropy_mean": s.teacher_entropy_sum / max(sdpo, 1.0),
        "teacher/divergence_mean": s.divergence_sum / max(sdpo, 1.0),
        "samples/teacher_forward": s.teacher_runs,
        "dw/w_tilde_mean": w_mean,
        "dw/w_tilde_std": math.sqrt(max(w_var, 0.0)),
        "grad_norm": s.grad_norm_sum / s.optimizer_steps if s.optimizer_steps else math.nan,
        "train/skipped_steps": s.skipped,
        "train/lr": s.lr,
        "logprob/gap_mean": s.rollout_logp_gap_sum / tokens,
        "logprob/gap_max": s.rollout_logp_gap_max,
        "loss/is_masked_frac": (s.rejected_tokens - s.stale_tokens + s.is_zeroed_tokens) / scored,
        "loss/stale_masked_frac": s.stale_tokens / scored,
        "time/score_s": s.score_s,
        "time/teacher_s": s.teacher_s,
        "time/train_s": s.train_s,
        "time/weight_sync_s": sync_s,
        "time/step_s": step_s,
        "perf/tokens_per_s": tokens / max(step_s, 1e-9),
    }
    if s.topk_kl_tokens:  # rollout.parity_top_k > 0 (losses/parity.py)
        m["logprob/topk_kl_mean"] = s.topk_kl_sum / s.topk_kl_tokens
        m["logprob/topk_kl_max"] = s.topk_kl_max
    if s.moe:  # MoE policies: the router metrics of the scoring pass (trainer/microbatches/moe_replay.py)
        m["moe/expert_load_max_over_mean"] = s.moe_expert_load
        m["moe/router_entropy"] = s.moe_router_entropy
        if s.moe_compared:
            m["moe/topk_mismatch_share"] = s.moe_topk_mismatch
            m["moe/router_disagreement_share"] = s.moe_router_disagreement
    return merge_metrics(batch.metrics, m)
