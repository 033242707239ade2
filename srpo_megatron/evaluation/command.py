"""``srpo eval RECIPE --checkpoint DIR``: avg@k (and greedy) of a checkpoint on the recipe's held-out data.

``DIR`` is a run directory (its newest checkpoint that verifies, picked as ``srpo train`` resumes: a
missing, garbage or escaping ``latest`` is only a hint), a training checkpoint (verified against its
manifest), a converter output (both exported to a temporary HF folder first, through the one conversion
table) or an HF folder. The recipe's rewards are registered and its held-out data read and checked
before any checkpoint is read, so a data or reward error comes first, in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from srpo_megatron.config import ConfigError, TrainConfig, load_recipe
from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME, megatron_to_hf
from srpo_megatron.conversion.checkpoint_files import checkpoint_to_read
from srpo_megatron.evaluation.avg_at_k import build_eval_benchmarks, greedy_accuracy, run_eval
from srpo_megatron.rewards import RewardPool, register_reward, reward_target
from srpo_megatron.rollout.factory import build_engine, load_tokenizer
from srpo_megatron.rollout.multi_turn import multi_turn_rollout


def _log(msg: str) -> None:
    print(f"srpo eval: {msg}", file=sys.stderr, flush=True)


def check_eval_inputs(cfg: TrainConfig, tokenizer: Any) -> None:
    """The recipe's rewards registered and the held-out data read: no prompts, a row kind without a
    reward, or a reward target that does not import is one line (ConfigError) before any model loads."""
    for kind, target in cfg.rollout.reward_fns.items():
        register_reward(kind, target)
    benches = build_eval_benchmarks(cfg.data, tokenizer, cfg.eval.max_prompts_per_benchmark)
    empty = [name for name, ps in benches.items() if not ps]
    if not benches or empty:
        raise ConfigError(
            f"srpo eval has no held-out prompts (data.eval_files={cfg.data.eval_files}, data.arithmetic "
            f"{'set' if cfg.data.arithmetic else 'unset'}{f', empty: {empty}' if empty else ''}): set "
            "data.eval_files to JSONL files with rows, or data.arithmetic"
        )
    targets = set()
    for kind in sorted({p.row.kind for ps in benches.values() for p in ps}):
        try:
            targets.add(reward_target(kind))
        except KeyError as e:
            raise ConfigError(f"{e.args[0]}; add it to rollout.reward_fns") from None
    rollout = cfg.rollout
    workers = min(cfg.eval.reward_workers, 1)
    with RewardPool(
        workers, cfg.eval.reward_timeout_s, import_timeout_s=rollout.reward_import_timeout_s
    ) as pool:
        problem = pool.check_targets(sorted(targets))
    if problem:
        raise ConfigError(problem)


def eval_main(args: argparse.Namespace) -> int:
    cfg = load_recipe(args.recipe, args.override)
    out = Path(args.out or Path(cfg.run.dir) / "eval" / "manual")
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    check_eval_inputs(cfg, tokenizer)
    ckpt = checkpoint_to_read(args.checkpoint, _log)  # train's selection and manifest check
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = ckpt
        if (ckpt / HF_CONFIG_NAME).is_file():
            hf_dir = megatron_to_hf(ckpt, Path(tmp) / "hf", progress=lambda _: None, verified=True)
        elif not (ckpt / "config.json").is_file():
            raise FileNotFoundError(
                f"--checkpoint {ckpt} is neither a run directory, a training/converted checkpoint (with "
                f"{HF_CONFIG_NAME}) nor an HF folder (with config.json)"
            )
        engine = build_engine(cfg.rollout, str(hf_dir))
        try:
            allow = cfg.rollout.allow_reward_errors  # training's rule: all rewards failed is refused
            mt = multi_turn_rollout(cfg, tokenizer)
            avg = run_eval(
                engine,
                tokenizer,
                cfg.data,
                cfg.eval,
                out / "avg_at_k",
                allow_reward_errors=allow,
                multi_turn=mt,
            )
            result = {
                "checkpoint": str(ckpt),
                f"avg@{cfg.eval.k}": avg["mean_avg_at_k"],
                **{f"{name}/avg@{cfg.eval.k}": b["avg_at_k"] for name, b in avg["benchmarks"].items()},
            }
            if cfg.train.eval_greedy:
                result["greedy"] = greedy_accuracy(engine, tokenizer, cfg, out / "greedy")
        finally:
            engine.shutdown()
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0
