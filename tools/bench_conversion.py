#!/usr/bin/env python3
"""Benchmark HF -> megatron conversion against a plain safetensors read+write of the same bytes.

Builds a random HF checkpoint (default: SmolLM2-135M's shapes, fp32), then, each in a fresh child
process (so the peak-RSS numbers are not polluted by each other), ``--repeats`` times alternately:
  1. copy:    read every tensor with ``safe_open`` and write them all with ``save_file``;
  2. convert: ``srpo_megatron.conversion.checkpoint.hf_to_megatron`` (dist_checkpointing output).
Prints per-stage lines, then one JSON object as the last line with
``throughput_vs_copy`` (best copy seconds / best convert seconds, same bytes) and
``peak_rss_vs_largest_tensor`` ((peak RSS - RSS after imports) / largest tensor bytes, worst run) for the
conversion. Peak RSS is the kernel's VmHWM, restarted after the imports. Goals (issue #4): >= 0.5 and
<= 3; this script reports them, it does not assert them.

    tools/bench_conversion.py [--layers 30] [--hidden 576] [--vocab 49152] [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS count (VmHWM) from the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    """Peak RSS of this process's address space. Not ``ru_maxrss``: that keeps the peak of the forked
    parent's copy across exec, so a child of a large parent reports the parent's RSS."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(mode: str, src: str, dst: str) -> None:
    import megatron.core.dist_checkpointing  # noqa: F401 - imports belong to the baseline
    import torch  # noqa: F401 - imported before the baseline, like the converter's own imports
    from safetensors import safe_open
    from safetensors.torch import save_file

    import srpo_megatron.conversion.stream_writer
    import srpo_megatron.models.policy
    import srpo_megatron.parallel  # noqa: F401
    from srpo_megatron.conversion.checkpoint import hf_to_megatron

    baseline = _rss_now()
    _reset_peak_rss()
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
    peak = _peak_rss()
    print(json.dumps({"seconds": seconds, "peak_above_baseline": peak - baseline}))


def _run_child(mode: str, src: Path, dst: Path) -> dict:
    # Both stages start from no output: removing a previous run's files is not part of either.
    shutil.rmtree(dst, ignore_errors=True)
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
    p.add_argument("--repeats", type=int, default=5, help="runs of each stage (best time, worst peak)")
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

    # Alternate the two stages and keep each one's best time (and worst peak): on a shared machine a
    # single run of either can be slowed by others' load, which would bias the ratio either way.
    runs: dict[str, list[dict]] = {"copy": [], "convert": []}
    for _ in range(args.repeats):
        runs["copy"].append(_run_child("copy", src, work / "copy"))
        runs["convert"].append(_run_child("convert", src, work / "megatron"))
    copy, conv = (
        {
            "seconds": min(r["seconds"] for r in stage),
            "peak_above_baseline": max(r["peak_above_baseline"] for r in stage),
        }
        for stage in (runs["copy"], runs["convert"])
    )
    for name, stage in (("plain copy", copy), ("conversion", conv)):
        rate = total / stage["seconds"] / 1e6
        print(f"{name}: {stage['seconds']:.2f} s, {rate:.0f} MB/s (best of {args.repeats})")
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
