"""Resuming a run: which checkpoint, and which recipe changes a resumed run may make.

A checkpoint records the recipe that was in force (``recipe.yaml``). On resume the current recipe is
compared with it key by key: a key in :data:`MAY_CHANGE_ON_RESUME` is applied (and logged); any other
changed key is refused, because the checkpoint already fixes it (the weights' shapes, the optimizer's
moments and LR schedule, the data cursor, the objective). ``<run>/config.yaml`` is then rewritten with
the recipe in force, so it never claims a value the run does not use.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from srpo_megatron.config import ConfigError, to_dict

# Recipe keys a resumed run may change (fnmatch patterns over dotted keys) and why that is safe.
# Every other key is refused when it differs from the checkpoint's recipe.yaml.
MAY_CHANGE_ON_RESUME: dict[str, str] = {
    "train.steps": "the loop runs to the new count (the LR schedule is constant after warm-up)",
    "train.micro_batch_size": "memory only: an optimizer step still sums the same samples",
    "train.skip_nonfinite": "a guard, not part of the update",
    "train.eval_at_ends": "evaluation only",
    "train.eval_greedy": "evaluation only",
    "eval.*": "evaluation cadence and settings; training never reads them",
    "data.eval_files": "held-out sets: evaluation only",
    "run.dir": "where the run lives: a copied or moved run directory resumes from its own checkpoints",
    "run.save_every": "checkpoint cadence",
    "run.keep_last": "checkpoint retention",
    "run.tensorboard": "logging",
    "run.wandb_project": "logging",
    "run.progress_bar": "logging",
    "run.restart": "read before resuming",
    "run.checkpoint_fully_reshardable": "the format of the next saves; a load reads the format saved",
    "model.megatron_checkpoint": "initial weights only; a resumed run loads the checkpoint",
    "rollout.reward_workers": "how rewards are computed, not what they are",
    "rollout.reward_timeout_s": "how long a reward may take",
    "rollout.max_batch_size": "CPU engine batching: same samples, other grouping",
    "rollout.sglang.request_timeout_s": "engine failure detection",
    "rollout.sglang.startup_timeout_s": "engine failure detection",
    "rollout.sglang.concurrent_requests": "throughput only: the same samples, fewer or more in flight",
    "parallel.tp": "dist_checkpointing reshards the model, and a fully_reshardable optimizer, on load",
    "parallel.pp": "dist_checkpointing reshards the model, and a fully_reshardable optimizer, on load",
    "parallel.sequence_parallel": "activation layout only",
    "train.max_tokens_per_micro_batch": "memory only: packing leaves the objective unchanged",
    "train.eval_at_start": "evaluation only",
    "performance.*": "kernels, recompute and overlap: the same maths",
    "parallel.teacher_offload": "memory only: where the bf16 teacher waits between its forwards",
    "parallel.offload_during_rollout": "memory only: where the trainer's state waits during rollouts",
    "parallel.teacher_fp32": "the fp32 EMA is saved whole per parameter: full and sharded load it alike",
}
# Why the rest is refused, by section (for the error message).
_FIXED_BECAUSE = {
    "model": "the checkpoint's weights belong to that model",
    "data": "the data cursor and order belong to those files and seed",
    "optim": "the LR schedule and Adam moments are restored from the checkpoint",
    "loss": "the objective the run optimises",
    "teacher": "the teacher's state was built with it",
    "rollout": "sampling is part of the objective",
    "parallel": "the optimizer state layout",
    "run": "the run's identity",
    "train": "the update the optimizer state was built with",
    "moe": "the router and experts the checkpoint was trained with",
}


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def may_change(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE_ON_RESUME)


def recipe_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """``(applied, refused)``: ``"key: old -> new"`` lines for every key that differs in both recipes.

    Keys only one recipe has (a newer or older srpo_megatron) are not compared.
    """
    old, new = flatten(saved), flatten(current)
    applied, refused = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] != new[key]:
            (applied if may_change(key) else refused).append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return applied, refused


def check_resume_recipe(cfg: Any, ckpt: Path, log: Callable[[str], None] = print) -> list[str]:
    """Refuse recipe changes the checkpoint fixes; log and return the ones that are applied."""
    from srpo_megatron.trainer.run.checkpoint import RECIPE_FILE

    saved = yaml.safe_load((ckpt / RECIPE_FILE).read_text())
    applied, refused = recipe_changes(saved, to_dict(cfg))
    if refused:
        sections = sorted({line.split(".", 1)[0] for line in refused})
        why = "; ".join(f"{s}: {_FIXED_BECAUSE.get(s, 'fixed by the checkpoint')}" for s in sections)
        raise ConfigError(
            f"resuming from {ckpt} with a changed recipe: {', '.join(refused)} cannot change on resume "
            f"({why}); set them back (see the checkpoint's recipe.yaml), or start a new run.dir"
        )
    for line in applied:
        log(f"resume: applying recipe change {line}")
    return applied


def resume_point(cfg: Any, log: Callable[[str], None] = print) -> Path | None:
    """Collective: clean temporaries, pick the checkpoint to resume (None: step 0), check the recipe."""
    import torch.distributed as dist

    from srpo_megatron.conversion.checkpoint_files import clean_temporaries, find_resume_checkpoint

    root = Path(cfg.run.dir) / "checkpoints"
    if (not dist.is_initialized() or dist.get_rank() == 0) and root.is_dir():
        clean_temporaries(root, log)
    if dist.is_initialized():
        dist.barrier()
    ckpt = find_resume_checkpoint(cfg.run.dir, cfg.run.restart, log, keep_last=cfg.run.keep_last)
    if ckpt is not None:
        check_resume_recipe(cfg, ckpt, log)
    return ckpt
