"""Benchmark: the default checkpoint save (distributed optimizer, megatron's ``dp_reshardable``) against
``fully_reshardable`` (``run.checkpoint_fully_reshardable=true``), on CPU.

The tiny Qwen3-MoE of the tests (the sizes of ``srpo_megatron.testing.tiny.write_tiny_qwen3_moe``: 2 layers,
hidden 64, 4 experts top-2, the real Qwen vocabulary; bf16 params with fp32 main params and Adam moments, an
EMA teacher) at DP 2 (two processes, gloo), after one real trainer step. After one uncounted save per format
(first-save set-up: it validates the sharding and sets up the save strategy the trainer then keeps per
format, megatron's cached distribution and save plan), each repeat saves the same state once in each
format, back to back, order alternating, with ``save_checkpoint`` (the trainer's own: dist_checkpointing
without torch.save's zip CRC32s, RNG and trainer files, the manifest's SHA-256 of every file, fsyncs, the
atomic rename, pruning to ``keep_last=1``), so both formats carry the same guarantees. A save's time is
the slower rank's; the figures are medians over repeats with their
min/max, and ``ratio`` = fully_reshardable / default for the whole save (``ratio_dist_checkpointing``: the
dist_checkpointing part alone). ``parts_*`` are save_checkpoint's own timings: ``dist_checkpointing_s``
(now including the SHA-256 of the data files, taken while megatron's writers write them:
``trainer/run/hashed_save.py``), ``extras_s`` (RNG and trainer files), ``digest_s`` (fsync and hash of the
files not hashed at write time, the manifest's gather), ``finalize_s`` (manifest, directory fsyncs, rename,
``latest``; the pruning runs in a background thread that the next save waits for, inside its time). Each
checkpoint is then loaded into a fresh policy, timed the same way (a resume reads the saved format). The load
average before and after is in the JSON line: on a shared machine the ratio moves with it.

Measured: see tools/MEASURED.md (the checkpoint entries).

Why the default is faster: ``fully_reshardable`` gathers every optimizer shard onto DP rank 0 and stores it
model-shaped (one rank writes it all); ``dp_reshardable`` has every rank write its own bucket shards, with
no gather (megatron-core ``DistributedOptimizer.sharded_state_dict``).

Usage: ``python tools/bench_checkpoint.py [--repeats 5]``; the last line is one JSON object (``save_s_fast``,
``save_s_reshardable``, ``ratio`` and per repeat, min/max, the parts, load times, bytes, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
FORMATS = {"fast": "false", "reshardable": "true"}
PARTS = ("dist_checkpointing_s", "extras_s", "digest_s", "finalize_s")  # save_checkpoint's timings


def write_tiny_moe(root: Path) -> tuple[Path, Path, Path]:
    """The tests' tiny Qwen3-MoE folder (same sizes) and a one-prompt JSONL: (root, hf_dir, data)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from srpo_megatron.data.assets import qwen3_tokenizer

    tok = qwen3_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    hf = root / "qwen3_moe"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(hf)
    tok.save_pretrained(hf)
    data = root / "train.jsonl"
    data.write_text(json.dumps({"prompt": "x", "system": None, "answer": "-", "kind": "coin"}) + "\n")
    return root, hf, data


def _policy(tiny, run_dir: str, fully: str):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.state.policy import Policy

    _, hf, data = tiny
    ov = [
        f"model.hf_dir={hf}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        f"run.checkpoint_fully_reshardable={fully}",
        "parallel.distributed_optimizer=true",
        "model.params_dtype=bf16",
    ]
    return Policy(load_config(TrainConfig, str(RECIPE), ov), initialize_model_parallel(1, 1, seed=1))


def _samples(dp_rank: int):
    import torch

    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(dp_rank)
    return [
        Sample(
            0,
            m,
            torch.randint(10, 2000, (4,), generator=g).tolist(),
            [7, 8, 9, 10],
            [-2.0] * 4,
            advantage=1.0,
        )
        for m in range(4)
    ]


def _rank_main(rank, world, tiny, root: str, repeats: int) -> dict:
    import torch.distributed as dist

    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.run.checkpoint import load_checkpoint, save_checkpoint

    policy = _policy(tiny, f"{root}/train", "false")
    learn(policy, scoring_pass(policy, _samples(rank)), 1)
    policy.update_teacher()
    saves: dict[str, list[dict]] = {f: [] for f in FORMATS}
    for r in range(-1, repeats):  # r = -1: one uncounted save per format (first-save set-up)
        for f in FORMATS if r % 2 == 0 else reversed(FORMATS):
            policy.cfg.run.checkpoint_fully_reshardable = FORMATS[f] == "true"
            parts: dict[str, float] = {}
            dist.barrier()
            t0 = time.monotonic()
            save_checkpoint(
                policy, f"{root}/{f}", r + 2, {"weight_version": r + 2}, keep_last=1, timings=parts
            )
            if r >= 0:
                saves[f].append({"total": time.monotonic() - t0, **parts})
    loads = {}
    for f in FORMATS:
        fresh = _policy(tiny, f"{root}/{f}", "false")
        dist.barrier()
        t0 = time.monotonic()
        load_checkpoint(fresh, Path(root) / f / "checkpoints" / f"step_{repeats + 1:06d}", log=lambda _: None)
        loads[f] = time.monotonic() - t0
    return {"saves": saves, "loads": loads}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from srpo_megatron.local_ranks import run_distributed

    load_before = os.getloadavg()[0]
    print(f"load average before: {load_before:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        tiny = write_tiny_moe(Path(tmp))
        ranks = run_distributed(_rank_main, 2, tiny, tmp, args.repeats, timeout=3600)
        size = {
            f: _dir_bytes(Path(tmp) / f / "checkpoints" / f"step_{args.repeats + 1:06d}") for f in FORMATS
        }
    slowest = lambda f, i, k: max(r["saves"][f][i][k] for r in ranks)  # noqa: E731
    med = {
        (f, k): statistics.median(slowest(f, i, k) for i in range(args.repeats))
        for f in FORMATS
        for k in ("total", *PARTS)
    }
    spread = {}
    for f in FORMATS:
        totals = [round(slowest(f, i, "total"), 3) for i in range(args.repeats)]
        spread[f] = [min(totals), max(totals)]
        parts = ", ".join(f"{k} {med[f, k]:.3f}" for k in PARTS)
        print(f"{f}: save s per repeat {totals}, median parts: {parts}; {size[f] / 1e6:.1f} MB", flush=True)
    ratios = [slowest("reshardable", i, "total") / slowest("fast", i, "total") for i in range(args.repeats)]
    load_after = os.getloadavg()[0]
    print(f"load average after: {load_after:.2f}", flush=True)
    result = {
        "save_s_fast": round(med["fast", "total"], 3),
        "save_s_reshardable": round(med["reshardable", "total"], 3),
        "ratio": round(med["reshardable", "total"] / med["fast", "total"], 2),
        "dist_checkpointing_s_fast": round(med["fast", "dist_checkpointing_s"], 3),
        "dist_checkpointing_s_reshardable": round(med["reshardable", "dist_checkpointing_s"], 3),
        "ratio_dist_checkpointing": round(
            med["reshardable", "dist_checkpointing_s"] / med["fast", "dist_checkpointing_s"], 2
        ),
        "load_s_fast": round(max(r["loads"]["fast"] for r in ranks), 3),
        "load_s_reshardable": round(max(r["loads"]["reshardable"] for r in ranks), 3),
        "mb_fast": round(size["fast"] / 1e6, 1),
        "mb_reshardable": round(size["reshardable"] / 1e6, 1),
        "ratio_per_repeat": [round(r, 2) for r in ratios],
        "save_s_fast_min_max": spread["fast"],
        "save_s_reshardable_min_max": spread["reshardable"],
        "parts_fast": {k: round(med["fast", k], 3) for k in PARTS},
        "parts_reshardable": {k: round(med["reshardable", k], 3) for k in PARTS},
        "load_avg_before_after": [round(load_before, 2), round(load_after, 2)],
        "repeats": args.repeats,
    }
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
