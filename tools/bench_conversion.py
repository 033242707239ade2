#!/usr/bin/env python3
"""Benchmark HF -> megatron conversion against a plain safetensors read+write of the same bytes.

Builds a random HF checkpoint (default: SmolLM2-135M's shapes, fp32), then, each in a fresh child
process (so the peak-RSS numbers are not polluted by each other):
  1. copy:    read every tensor with ``safe_open`` and write them all with ``save_file``;
  2. convert: ``srpo_megatron.conversion.checkpoint.hf_to_megatron`` (dist_checkpointing output).
Prints per-stage lines, then one JSON object as the last line with
``throughput_vs_copy`` (copy seconds / convert seconds, same bytes) and ``peak_rss_vs_largest_tensor``
((peak RSS - RSS after imports) / largest tensor bytes) for the conversion. Goals (issue #4): >= 0.5 and
<= 3. The converter holds the TP1 model once (see conversion/checkpoint.py), so the RSS ratio grows with
model bytes / largest tensor bytes; this script reports it, it does not assert it.

    tools/bench_conversion.py [--layers 30] [--hidden 576] [--vocab 49152] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _child(mode: str, src: str, dst: str) -> None:
    import megatron.core.dist_checkpointing  # noqa: F401 - imports belong to the baseline
    import torch  # noqa: F401 - imported before the baseline, like the converter's own imports
    from safetensors import safe_open
    from safetensors.torch import save_file

    import srpo_megatron.models.policy  # noqa: F401
    from srpo_megatron.conversion.checkpoint import hf_to_megatron

    baseline = _rss_now()
    start = time.perf_counter()
    if mode == "copy":
        tensors = {}
        for f in sorted(Path(src).glob("*.safetensors")):
            with safe_open(f, framework="pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
        Path(dst).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(dst) / "model.safetensors"))
    else:
        hf_to_megatron(src, dst, progress=lambda _: None)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_above_baseline": peak - baseline}))


def _run_child(mode: str, src: Path, dst: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"{mode} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description="HF->megatron conversion throughput and peak memory")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(*args.child)
        return

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_conversion_"))
    src = work / "hf"
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(src, max_shard_size="200MB")
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    total, largest = sum(sizes), max(sizes)
    del model
    print(f"checkpoint: {total / 1e6:.1f} MB in {len(sizes)} tensors, largest {largest / 1e6:.1f} MB")

    copy = _run_child("copy", src, work / "copy")
    print(f"plain copy: {copy['seconds']:.2f} s, {total / copy['seconds'] / 1e6:.0f} MB/s")
    conv = _run_child("convert", src, work / "megatron")
    print(f"conversion: {conv['seconds']:.2f} s, {total / conv['seconds'] / 1e6:.0f} MB/s")
    result = {
        "throughput_vs_copy": round(copy["seconds"] / conv["seconds"], 3),
        "peak_rss_vs_largest_tensor": round(conv["peak_above_baseline"] / largest, 3),
        "copy_peak_rss_vs_largest_tensor": round(copy["peak_above_baseline"] / largest, 3),
        "model_bytes_vs_largest_tensor": round(total / largest, 3),
        "checkpoint_mb": round(total / 1e6, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing.save spawns a manager process: keep the guard
    main()
