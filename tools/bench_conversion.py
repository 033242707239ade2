#!/usr/bin/env python3
"""Benchmark HF <-> megatron conversion against a plain safetensors read+write of the same bytes.

Builds three random HF checkpoints (fp32): a dense one (default: SmolLM2-135M's shapes, 273 tensors), a
Qwen3-MoE one with many small experts (default: 8 layers x 128 experts, ~3,100 tensors) and a DeepSeek-V3
shaped one (default: 8 layers, the first dense, 256 routed experts + 1 shared, ~5,400 tensors; MLA when
the DeepSeek-V3 table exists, else the same MoE as GLM-4.5: ``model_type`` in its JSON). For each, in a
fresh child process per run (so the peak-RSS numbers are not polluted by each other), ``--repeats`` times
in turn (copy, convert and export interleaved, so a burst of load from other jobs hits all three alike):
  1. copy:    read every tensor with ``safe_open``, write them all with ``save_file``, and fsync the file
              and its directory: the same durability as the converter, whose output is fsynced before it
              is renamed into place (a copy left in the page cache would measure memory, not the disk);
  2. convert: ``srpo_megatron.conversion.checkpoint.hf_to_megatron`` (torch_dist output, fsynced);
  3. export:  ``megatron_to_hf`` of a converted checkpoint back to HF safetensors (fsynced).
Dirty pages are flushed (``os.sync``) before every run, so no run pays for the previous one's writeback.
Two more rows read blockwise-FP8 folders (``dense_fp8``: the dense model, ``deepseek_fp8``: a DeepSeek-V3
shape with 64 experts whose widths end in partial 128x128 blocks): the model in bf16, every projection of
the layers quantized with ``ops/fp8_blocks`` (float8_e4m3fn + float32 ``weight_scale_inv``), a
``quantization_config``; the conversion dequantizes them to bf16, the copy copies the FP8 bytes.
Prints per-stage lines, then one JSON object as the last line with, per checkpoint (``dense``, ``moe``,
``deepseek``, ``dense_fp8``, ``deepseek_fp8``):
``throughput_vs_copy`` / ``export_throughput_vs_copy`` (median copy seconds / median convert or export
seconds, same bytes), the same from the best runs (``*_best``), ``cpu_vs_copy`` / ``export_cpu_vs_copy``
(median CPU seconds of the copy / of the conversion or export: user + system time of the child, all
threads; less sensitive to other jobs' load than wall time), the load average over the runs, and
``peak_rss_vs_largest_tensor`` / ``export_peak_rss_vs_largest_tensor`` ((peak RSS - RSS after imports) /
largest tensor bytes, worst run). Peak RSS is the kernel's VmHWM, restarted after the imports. Goals
(issues #4, #13): throughput >= 0.5, peak <= 3; reported, not asserted.

    tools/bench_conversion.py [--layers 30] [--hidden 576] [--vocab 49152] [--moe-experts 128]
                              [--ds-layers 8] [--ds-experts 256] [--only dense|moe|deepseek]
                              [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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
    from srpo_megatron.conversion.checkpoint import hf_to_megatron, megatron_to_hf
    from srpo_megatron.durable_io import fsync_dir, fsync_file

    baseline = _rss_now()
    _reset_peak_rss()
    cpu0 = os.times()
    start = time.perf_counter()
    if mode == "copy":
        tensors = {}
        for f in sorted(Path(src).glob("*.safetensors")):
            with safe_open(f, framework="pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
        Path(dst).mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(Path(dst) / "model.safetensors"))
        # What the converter's atomic_output_dir does before its rename: the data, then the entries.
        fsync_file(Path(dst) / "model.safetensors")
        fsync_dir(Path(dst))
        fsync_dir(Path(dst).parent)
    elif mode == "convert":
        hf_to_megatron(src, dst, progress=lambda _: None)
    else:
        megatron_to_hf(src, dst, progress=lambda _: None)
    seconds = time.perf_counter() - start
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    peak = _peak_rss()
    written = sum(f.stat().st_size for f in Path(dst).rglob("*") if f.is_file())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "peak_above_baseline": peak - baseline,
                "written": written,
            }
        )
    )


def _run_child(mode: str, src: Path, dst: Path, keep: bool = False) -> dict:
    # Every stage starts from no output and no dirty pages: removing a previous run's files and writing
    # back what it left in the page cache are not part of the next run.
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(src), str(dst)],
        capture_output=True,
        text=True,
        check=False,
    )
    if not keep:  # the next stages do not need it: keep the disk footprint to one output
        shutil.rmtree(dst, ignore_errors=True)
    if out.returncode:
        raise SystemExit(f"{mode} child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dense_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )


def _moe_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=args.moe_hidden,
        intermediate_size=2 * args.moe_hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.moe_experts,
        num_experts_per_tok=8,
        num_hidden_layers=args.moe_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=args.moe_vocab,
        tie_word_embeddings=False,
    )


def _deepseek_config(args, fp8: bool = False):
    """DeepSeek-V3's shape, small: MLA, dense first layer, 1 shared + many routed experts in 8 groups (4
    chosen, top-8). Until the DeepSeek-V3 table is in ``conversion.table.TABLES`` the same MoE is built as
    GLM-4.5 (GQA attention: no MLA rows measured); the JSON names which (``model_type``)."""
    from srpo_megatron.conversion.table import TABLES

    if fp8:  # widths with partial 128x128 edge blocks (384 = 3 blocks, 192 = 1.5), fewer experts
        args = argparse.Namespace(
            **{**vars(args), "ds_hidden": 384, "ds_moe_intermediate": 192, "ds_experts": 64}
        )
    moe = dict(
        hidden_size=args.ds_hidden,
        intermediate_size=4 * args.ds_hidden,
        moe_intermediate_size=args.ds_moe_intermediate,
        n_routed_experts=args.ds_experts,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=1,
        num_hidden_layers=args.ds_layers,
        num_attention_heads=4,
        vocab_size=args.moe_vocab,
        tie_word_embeddings=False,
    )
    if "deepseek_v3" in TABLES:
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **moe,
            num_key_value_heads=4,
            q_lora_rank=args.ds_hidden // 2,
            kv_lora_rank=args.ds_hidden // 4,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
        )
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**moe, num_key_value_heads=2, head_dim=64, attention_bias=True)


def _fp8_folder(src: Path, dst: Path) -> None:
    """``src`` (a bf16 HF folder) as a blockwise-FP8 one: Fp8Layout's weights quantized (128x128 blocks)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from srpo_megatron.conversion.fp8_layout import Fp8Layout
    from srpo_megatron.ops import fp8_blocks

    qc = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    layout = Fp8Layout.from_quantization_config(qc, str(src))
    dst.mkdir(parents=True)
    weight_map = {}
    for i, f in enumerate(sorted(src.glob("*.safetensors"))):
        out = {}
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                t = h.get_tensor(k)
                if layout.is_fp8(k):
                    out[k], out[Fp8Layout.scale_name(k)] = fp8_blocks.quantize(t)
                else:
                    out[k] = t
        name = f"model-{i:05d}.safetensors"
        save_file(out, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))


_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}


def _bench(name: str, config, work: Path, repeats: int, fp8: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    src = work / "hf"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if fp8 else torch.float32)
    model.save_pretrained(work / "hf_bf16" if fp8 else src, max_shard_size="200MB")
    del model
    if fp8:
        _fp8_folder(work / "hf_bf16", src)
        shutil.rmtree(work / "hf_bf16")
    from safetensors import safe_open

    sizes = []
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a dict
                sizes.append(_ITEMSIZE[h.get_slice(k).get_dtype()] * _prod(h.get_slice(k).get_shape()))
    total, largest = sum(sizes), max(sizes)
    print(f"{name}: {total / 1e6:.1f} MB in {len(sizes)} tensors, largest {largest / 1e6:.1f} MB", flush=True)
    # The export stage reads a converted checkpoint: made once, outside the timings.
    _run_child("convert", src, work / "megatron_src", keep=True)

    # Interleave the stages and report medians: on a shared machine a single run of any of them can be
    # slowed by others' load, which would bias the ratios either way.
    runs: dict[str, list[dict]] = {"copy": [], "convert": [], "export": []}
    loads = []
    for _ in range(repeats):
        runs["copy"].append(_run_child("copy", src, work / "copy"))
        runs["convert"].append(_run_child("convert", src, work / "megatron"))
        runs["export"].append(_run_child("export", work / "megatron_src", work / "export"))
        loads.append(os.getloadavg()[0])
        seconds = {stage: round(rs[-1]["seconds"], 2) for stage, rs in runs.items()}
        print(f"{name} run: {seconds} s, load average {loads[-1]:.1f}", flush=True)
    stats = {
        stage: {
            "seconds": statistics.median(r["seconds"] for r in rs),
            "best": min(r["seconds"] for r in rs),
            "cpu": statistics.median(r["cpu_seconds"] for r in rs),
            "peak_above_baseline": max(r["peak_above_baseline"] for r in rs),
            "written": statistics.median(r["written"] for r in rs),
        }
        for stage, rs in runs.items()
    }
    for stage, b in stats.items():
        rate = total / b["seconds"] / 1e6
        print(
            f"{name} {stage}: {b['seconds']:.2f} s median ({b['best']:.2f} best), {rate:.0f} MB/s, "
            f"{b['cpu']:.2f} CPU s (median of {repeats})"
        )
    copy, conv, exp = stats["copy"], stats["convert"], stats["export"]
    # An FP8 import writes bf16: about twice the bytes the copy of the FP8 folder writes. The headline
    # ratio stays the one a user sees (same input folder, wall time); this one is per byte written.
    per_byte = (conv["written"] / conv["seconds"]) / (copy["written"] / copy["seconds"])
    print(
        f"{name}: convert writes {conv['written'] / 1e6:.0f} MB, the copy {copy['written'] / 1e6:.0f} MB "
        f"({conv['written'] / copy['written']:.2f}x); per byte written the convert runs at "
        f"{per_byte:.2f}x the copy"
    )
    return {
        "throughput_vs_copy": round(copy["seconds"] / conv["seconds"], 3),
        "export_throughput_vs_copy": round(copy["seconds"] / exp["seconds"], 3),
        "throughput_vs_copy_best": round(copy["best"] / conv["best"], 3),
        "export_throughput_vs_copy_best": round(copy["best"] / exp["best"], 3),
        "cpu_vs_copy": round(copy["cpu"] / conv["cpu"], 3),
        "export_cpu_vs_copy": round(copy["cpu"] / exp["cpu"], 3),
        "peak_rss_vs_largest_tensor": round(conv["peak_above_baseline"] / largest, 3),
        "export_peak_rss_vs_largest_tensor": round(exp["peak_above_baseline"] / largest, 3),
        "copy_peak_rss_vs_largest_tensor": round(copy["peak_above_baseline"] / largest, 3),
        "model_bytes_vs_largest_tensor": round(total / largest, 3),
        "written_vs_copy": round(conv["written"] / copy["written"], 3),
        "bytes_written_throughput_vs_copy": round(per_byte, 3),
        "copy_seconds": round(copy["seconds"], 3),
        "convert_seconds": round(conv["seconds"], 3),
        "export_seconds": round(exp["seconds"], 3),
        "copy_cpu_seconds": round(copy["cpu"], 3),
        "convert_cpu_seconds": round(conv["cpu"], 3),
        "export_cpu_seconds": round(exp["cpu"], 3),
        "load_average": [round(min(loads), 1), round(max(loads), 1)],
        "repeats": repeats,
        "checkpoint_mb": round(total / 1e6, 1),
        "tensors": len(sizes),
        "model_type": config.model_type,
    }


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    p = argparse.ArgumentParser(description="HF<->megatron conversion throughput and peak memory")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--moe-experts", type=int, default=128)
    p.add_argument("--moe-hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--moe-vocab", type=int, default=32000)
    p.add_argument("--ds-layers", type=int, default=8)
    p.add_argument("--ds-experts", type=int, default=256)
    p.add_argument("--ds-hidden", type=int, default=256)
    p.add_argument("--ds-moe-intermediate", type=int, default=64)
    p.add_argument(
        "--only",
        choices=["dense", "moe", "deepseek", "dense_fp8", "deepseek_fp8"],
        help="benchmark one checkpoint only",
    )
    p.add_argument("--repeats", type=int, default=5, help="runs of each stage (median time, worst peak)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(*args.child)
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_conversion_"))
    result = {}
    cases = (
        ("dense", _dense_config(args)),
        ("moe", _moe_config(args)),
        ("deepseek", _deepseek_config(args)),
        ("dense_fp8", _dense_config(args)),
        ("deepseek_fp8", _deepseek_config(args, fp8=True)),
    )
    for name, config in cases:
        if args.only in (None, name):
            shutil.rmtree(work / name, ignore_errors=True)
            result[name] = _bench(name, config, work / name, args.repeats, fp8=name.endswith("_fp8"))
            shutil.rmtree(work / name, ignore_errors=True)  # ~2x the checkpoint, regenerated every time
    print(json.dumps(result))


if __name__ == "__main__":  # dist_checkpointing.save spawns a manager process: keep the guard
    main()
