"""Benchmark: the training pass on right-padded batches vs token-budget packed (THD) micro-batches.

Samples: ``--samples`` sequences of a fixed prompt plus a long-tailed response length (lognormal, mean ¼ of
``--max-response``, clipped at it), the shape of RL rollouts. The same real megatron ``GPTModel`` (local
spec + the project's SDPA core attention, fp32, TP1) runs forward + backward of a token-level loss over
every sample twice, measured in the same run:

  padded: micro-batches of ``--micro-batch-size`` samples, every sample right-padded to the step's longest
          sequence (what the trainer does without packing);
  packed: first-fit-decreasing micro-batches of at most ``--budget`` tokens (default: what one padded
          micro-batch holds, micro-batch size × the longest sequence, so both passes have the same
          activation memory), sequences laid end to end with ``PackedSeqParams`` (block-diagonal causal).

Waste = tokens processed ÷ real tokens. Time = CPU seconds (``time.process_time``) of a one-thread process,
best of ``--repeats``, so other jobs on a shared machine do not skew the ratio. Last line: one JSON object
with ``waste_padded``, ``waste_packed``, ``time_packed_vs_padded`` (goals: waste_packed ≤ 1.10, time ≤ 0.5).

    .venv/bin/python tools/bench_packing.py [--samples 32 --max-response 512]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from srpo_megatron.local_ranks import run_distributed
from srpo_megatron.trainer.microbatches.batches import Sequence, make_micro_batches
from srpo_megatron.trainer.microbatches.packing import pack, padding_waste, plan_micro_batches

VOCAB = 1024


def lengths(samples: int, prompt: int, max_response: int, seed: int) -> list[int]:
    """Prompt + lognormal response lengths with mean ≈ max_response/4 (σ = 1), clipped to [1, max]."""
    gen = torch.Generator().manual_seed(seed)
    mu = math.log(max_response / 4) - 0.5
    resp = torch.exp(mu + torch.randn(samples, generator=gen)).round().clamp(1, max_response)
    return [prompt + int(r) for r in resp]


def _worker(rank, world, args, lens):
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: F401  (import cost outside timing)

    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    torch.set_num_threads(1)
    initialize_model_parallel(1, 1)
    model = build_policy(
        {
            "model_type": "qwen3",
            "hidden_size": args.hidden,
            "intermediate_size": 3 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": args.hidden // 4,
            "vocab_size": VOCAB,
            "max_position_embeddings": max(lens) + 8,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "tie_word_embeddings": False,
        },
        parallel_output=False,
    )
    gen, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
    seqs = [(torch.randint(1, VOCAB, (n,), generator=gen).tolist(), 0, n - 1) for n in lens]
    padded = make_micro_batches([Sequence(*s) for s in seqs], args.micro_batch_size, max(lens), cpu)

    def padded_pass():
        for mb in padded:  # the trainer's own right-padded micro-batches
            logits = model(mb.tokens, mb.positions.expand_as(mb.tokens), None)
            loss = logits[mb.rows].float().logsumexp(-1).sum()
            loss.backward()

    def packed_pass():
        for members in plan_micro_batches(lens, budget):
            mb = pack(seqs, members)
            logits = model(mb.tokens, mb.positions, None, packed_seq_params=mb.packed_seq_params("cpu"))
            loss = logits[mb.rows].float().logsumexp(-1).sum()
            loss.backward()

    budget = args.budget or args.micro_batch_size * max(lens)
    times = {}
    for name, fn in (("padded", padded_pass), ("packed", packed_pass)):
        fn()  # warm-up
        best = math.inf
        for _ in range(args.repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        times[name] = best
    bins = plan_micro_batches(lens, budget)
    return {"times": times, "micro_batches_packed": len(bins), "budget": budget}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument(
        "--budget", type=int, default=0, help="packed token budget (0: micro-batch size x longest)"
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lens = lengths(args.samples, args.prompt, args.max_response, args.seed)
    budget = args.budget or args.micro_batch_size * max(lens)
    waste_padded = max(lens) * len(lens) / sum(lens)
    waste_packed = padding_waste(lens, plan_micro_batches(lens, budget), budget=None)
    (res,) = run_distributed(_worker, 1, args, lens, timeout=3600)
    t = res["times"]
    print(
        f"{len(lens)} samples, real tokens {sum(lens)}, longest {max(lens)}, mean {sum(lens) / len(lens):.0f}"
    )
    print(f"padded: {waste_padded:.2f}x tokens processed per real token, {t['padded']:.2f} CPU s")
    print(
        f"packed: {waste_packed:.3f}x ({res['micro_batches_packed']} micro-batches of <= {budget} tokens), "
        f"{t['packed']:.2f} CPU s"
    )
    result = {
        "waste_padded": round(waste_padded, 3),
        "waste_packed": round(waste_packed, 4),
        "time_packed_vs_padded": round(t["packed"] / t["padded"], 3),
        # each sequence padded to 8 = TP2 · 2·CP2 with sequence parallel (layout only, not timed)
        "waste_packed_tp2_cp2": round(
            padding_waste(lens, plan_micro_batches(lens, budget - budget % 8, 8), budget=None, multiple=8), 4
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
