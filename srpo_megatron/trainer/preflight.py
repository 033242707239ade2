"""Checks `srpo train` runs before loading the model, so bad input fails in seconds with one line.

- :func:`check_layout`: the world divides into TP × PP × CP × DP and the model and batch divide over them
  (heads and KV groups over TP, layers over PP, experts over EP once the recipe has ``parallel.ep``, the
  step's samples over mini-batches × DP).
- :func:`check_rewards`: every reward target the data needs is imported and called once on a dummy
  input, with a timeout, by the reward pool the run will score with (rank 0's worker processes).
- :func:`data_summary`: the one line that says how many rows were read, skipped, dropped, truncated.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from srpo_megatron.config import ConfigError
from srpo_megatron.models.architecture import pipeline_stage_layers


def check_layout(cfg: Any, world_size: int, hf_config: dict) -> None:
    """Refuse a parallel layout the world, the model or the batch cannot be split into."""
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, getattr(cfg.parallel, "cp", 1)
    if world_size % (tp * pp * cp):
        cp_part = f" × parallel.cp={cp}" if cp > 1 else ""
        raise ConfigError(
            f"{world_size} processes cannot be split into parallel.tp={tp} × parallel.pp={pp}{cp_part}; "
            f"launch a multiple of {tp * pp * cp} processes or change tp/pp/cp"
        )
    dp = world_size // (tp * pp * cp)  # CP ranks of a replica share its samples
    heads = hf_config.get("num_attention_heads")
    kv = hf_config.get("num_key_value_heads") or heads
    layers = hf_config.get("num_hidden_layers")
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    checks = [
        (heads, tp, "attention heads", "parallel.tp"),
        (kv, tp, "key/value heads (GQA groups)", "parallel.tp"),
        (experts, getattr(cfg.parallel, "ep", 1), "experts", "parallel.ep"),
    ]
    for count, size, what, key in checks:
        if count and size > 1 and count % size:
            raise ConfigError(
                f"model.hf_dir {cfg.model.hf_dir}: {count} {what} do not divide by {key}={size}; pick a "
                f"{key} that divides {count}"
            )
    if layers:  # PP need not divide the layers: the first and last stages take fewer (pipeline_stage_layers)
        try:
            pipeline_stage_layers(layers, pp)
        except ValueError as e:
            raise ConfigError(f"model.hf_dir {cfg.model.hf_dir}: {e}; change parallel.pp") from None
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    parts = cfg.train.mini_batches * dp
    if samples % parts:
        raise ConfigError(
            f"rollout.prompts_per_step × rollout.group_size = {samples} samples per step do not split into "
            f"train.mini_batches={cfg.train.mini_batches} × data-parallel size {dp} (= {world_size} "
            f"processes / (tp={tp} × pp={pp} × cp={cp})); make the samples a multiple of {parts}"
        )


def check_rewards(targets: list[str], rollout: Any) -> None:
    """Collective: rank 0 probes ``targets`` in the pool's kind of process; every rank raises on failure."""
    from srpo_megatron.rewards import RewardPool

    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        workers, timeout_s = min(rollout.reward_workers, 1), rollout.reward_timeout_s
        with RewardPool(workers, timeout_s, import_timeout_s=rollout.reward_import_timeout_s) as pool:
            problem = pool.check_targets(targets)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError(problem)


def data_summary(train_set: Any, eval_set: Any) -> str:
    """One log line with the row counts of both splits (read, skipped as bad, dropped, truncated)."""
    parts = []
    for name, ds in (("train", train_set), ("eval", eval_set)):
        s = ds.stats
        parts.append(
            f"{name}: {len(ds)} prompts from {s.num_rows} rows, {s.num_bad} bad rows skipped, "
            f"{s.num_dropped_overlong} dropped as over-long, {s.num_truncated} truncated"
        )
    return "data: " + "; ".join(parts)
