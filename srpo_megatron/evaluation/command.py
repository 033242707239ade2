"""``srpo eval RECIPE --checkpoint DIR``: avg@k (and greedy) of a checkpoint on the recipe's held-out data.

``DIR`` is a training checkpoint (``<run>/checkpoints/step_N`` or the run's ``latest``) or a converter
output (exported to a temporary HF folder first, through the one conversion table), or an HF folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from srpo_megatron.config import load_recipe
from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME, megatron_to_hf
from srpo_megatron.evaluation.avg_at_k import greedy_accuracy, run_eval
from srpo_megatron.rollout.factory import build_engine, load_tokenizer


def eval_main(args: argparse.Namespace) -> int:
    cfg = load_recipe(args.recipe, args.override)
    ckpt = Path(args.checkpoint)
    if (ckpt / "checkpoints" / "latest").is_file():  # a run directory
        ckpt = ckpt / "checkpoints" / (ckpt / "checkpoints" / "latest").read_text().strip()
    out = Path(args.out or Path(cfg.run.dir) / "eval" / "manual")
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = ckpt
        if (ckpt / HF_CONFIG_NAME).is_file():
            hf_dir = megatron_to_hf(ckpt, Path(tmp) / "hf", progress=lambda _: None)
        elif not (ckpt / "config.json").is_file():
            raise FileNotFoundError(
                f"--checkpoint {ckpt} is neither a training/converted checkpoint (with {HF_CONFIG_NAME}) "
                "nor an HF folder (with config.json)"
            )
        engine = build_engine(cfg.rollout, str(hf_dir))
        try:
            avg = run_eval(engine, tokenizer, cfg.data, cfg.eval, out / "avg_at_k")
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
