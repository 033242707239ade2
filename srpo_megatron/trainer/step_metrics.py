"""Assemble one step's method §6 metrics on rank 0 from the rollout batch and every rank's loss sums."""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from srpo_megatron.trainer.rollouts import RolloutBatch

_TIMES = ("score_s", "teacher_s", "train_s")


def _gather(per_opt_step: list[dict[str, float]]) -> list[list[dict[str, float]]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [per_opt_step]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, per_opt_step)
    return out


def step_metrics(
    batch: RolloutBatch, per_opt_step: list[dict[str, float]], sync_s: float, step_s: float
) -> dict[str, float]:
    """Collective. Loss metrics are sums over micro-batches, optimizer steps and contributing ranks.

    Only last-stage, TP-rank-0 ranks contribute (every TP rank holds the same values); phase times are
    the slowest rank's.
    """
    from megatron.core import parallel_state as ps

    contributes = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    gathered = _gather([{**d, "contrib": float(contributes)} for d in per_opt_step])
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    times = dict.fromkeys(_TIMES, 0.0)
    grad_norms: list[float] = []
    skipped = 0.0
    for rank_steps in gathered:
        for d in rank_steps:
            for key in _TIMES:
                times[key] = max(times[key], d[key])
            if not d["contrib"]:
                continue
            for key, v in d.items():
                if key.endswith("_max"):
                    maxes[key] = max(maxes.get(key, 0.0), v)
                elif key.endswith("_sum") or key in (
                    "loss",
                    "grpo_tokens",
                    "sdpo_tokens",
                    "tokens",
                    "teacher_runs",
                ):
                    sums[key] = sums.get(key, 0.0) + v
            grad_norms.append(d["grad_norm"])
            skipped = max(skipped, d["skipped"])
    tokens = max(sums.get("tokens", 0.0), 1.0)
    sdpo = sums.get("sdpo_tokens", 0.0)
    grpo = sums.get("grpo_tokens", 0.0)
    w_mean = sums.get("w_tilde_sum", 0.0) / max(sdpo, 1.0)
    w_var = sums.get("w_tilde_sq_sum", 0.0) / max(sdpo, 1.0) - w_mean**2
    m = dict(batch.metrics)
    m.update(
        {
            "loss/total": sums.get("loss", 0.0),
            "loss/grpo": sums.get("grpo_loss_sum", 0.0) / tokens,
            "loss/sdpo": sums.get("sdpo_loss_sum", 0.0) / tokens,
            "loss/grpo_clip_frac": sums.get("grpo_clipped_sum", 0.0) / max(grpo, 1.0),
            "tokens/grpo_frac": grpo / tokens,
            "tokens/sdpo_frac": sdpo / tokens,
            "tokens/total": tokens,
            "teacher/entropy_mean": sums.get("teacher_entropy_sum", 0.0) / max(sdpo, 1.0),
            "teacher/divergence_mean": sums.get("divergence_sum", 0.0) / max(sdpo, 1.0),
            "samples/teacher_forward": sums.get("teacher_runs", 0.0),
            "dw/w_tilde_mean": w_mean,
            "dw/w_tilde_std": math.sqrt(max(w_var, 0.0)),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "train/skipped_steps": skipped,
            "logprob/gap_mean": sums.get("rollout_logp_gap_sum", 0.0) / tokens,
            "logprob/gap_max": maxes.get("rollout_logp_gap_max", 0.0),
            "time/score_s": times["score_s"],
            "time/teacher_s": times["teacher_s"],
            "time/train_s": times["train_s"],
            "time/weight_sync_s": sync_s,
            "time/step_s": step_s,
            "perf/tokens_per_s": tokens / max(step_s, 1e-9),
        }
    )
    return m
