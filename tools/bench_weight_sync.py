"""Benchmark: reshard + transfer of a >= 1 GB policy from TP2xPP2 (4 gloo ranks) into rollout engines.

``--placement colocated`` (default): two engines (``--gpus-per-engine 2``) hosted on ranks 0 and 2, synced
with ``weights.engine_sync.sync_engines`` (each engine's host receives its own stage locally and the other
stage point-to-point from its replica's sender); the engine stand-in validates each tensor with the shared
gate and copies it into its own weights bucket by bucket, like SGLang. ``--placement separate``: one engine
process fed over per-stage broadcast groups (below).

Four trainer ranks hold a Llama-style megatron policy (random weights, fp32) at TP2xPP2; a separate engine
process holds the CPU ``HFEngine`` of the same architecture. Measured in the same run, alternating:

- **sync**: ``testing.sync_transports.send_stage`` — TP gather, conversion to HF names/shapes, byte-bounded
  buckets broadcast per stage, ``HFEngine.update_weights`` (validate all, then copy), acknowledgement;
- **plain copy**: the same number of bytes per stage, sent over the same channels in bucket-sized
  chunks of one reused buffer and received into fresh buffers (no gather, no conversion, no install).

Throughput ratio = plain-copy time / sync time (same bytes). Colocated mode runs a warm-up copy, then
``--repeats`` sync/copy pairs back to back (each pair sees the same machine load) and reports the median
pair ratio, the load average before and after, and per trainer rank the worst sync's peak extra memory
two ways: resident (the kernel's exact high-water mark ``VmHWM``, reset before each sync: what the
machine must have, glibc's retained free memory included) and live allocations (glibc's in-use bytes,
sampled every 1 ms: what the sync holds). The separate mode reports the same resident peak and also prints
the engine's extra memory (the CPU engine stages a full version before installing it, by design: atomic
updates).

``--fp8``: the FP8 row: bf16 sync (``dtype=bfloat16``) against the blockwise FP8 sync of the same policy
(``weights.fp8_sync``: each FP8-layout weight quantized per 128x128 block on the sender, sent as e4m3 +
``weight_scale_inv``) into engines holding those dtypes, alternating pairs; ratio = bf16 time / FP8 time.

``--lora-rank R``: the LoRA row, counted (no transfer runs): the bytes an adapter sync moves
(``weights/lora_sync.py``: the PEFT-named A/B of every adapted projection, bf16) against the full-weight
sync of the same model (every HF tensor, bf16), for the benchmark's model, a tiny Qwen3 with the real
151k vocabulary and Qwen3-8B; ratio = full bytes / adapter bytes.

Usage: ``python tools/bench_weight_sync.py [--layers 10 --hidden 1536 --bucket-mb 512 --repeats 3] [--fp8]
[--lora-rank 16]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

import psutil
import torch
import torch.distributed as dist

TP, PP = 2, 2


def hf_config(args) -> dict:
    return dict(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=4 if (args.hidden // 128) % 4 == 0 else 2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
_MALLINFO2_FIELDS = _MALLINFO2_FIELDS.split()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in _MALLINFO2_FIELDS]


def _in_use() -> int:
    """Bytes glibc malloc has handed out and not taken back (heap chunks in use + mmapped chunks), i.e.
    live allocations without the freed memory the allocator keeps resident."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakMemory:
    """Two peaks above the level at ``start``: resident memory (the kernel's exact high-water mark,
    reset at ``start``: what the machine must have, allocator retention included) and live allocations
    (glibc's in-use bytes, sampled every ``period_s``: what the code holds)."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.proc = psutil.Process()
        self.period_s = period_s

    def __enter__(self):
        self.rss_base = self.proc.memory_info().rss
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # restart VmHWM from the current RSS
        self.live_base = self.live_peak = _in_use()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.live_peak = max(self.live_peak, _in_use())
            time.sleep(self.period_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.live_peak = max(self.live_peak, _in_use())
        self.rss_extra = _vm_hwm() - self.rss_base
        self.live_extra = self.live_peak - self.live_base


def plain_stream(nbytes: int, bucket_bytes: int):
    """``nbytes`` as bucket-sized uint8 chunks of one reused buffer (content is irrelevant)."""
    buf = torch.zeros(min(nbytes, bucket_bytes), dtype=torch.uint8)
    k, left = 0, nbytes
    while left > 0:
        n = min(left, bucket_bytes)
        yield f"flat.{k}", buf[:n]
        k, left = k + 1, left - n


def engine_main(config: dict, ports: list[int], schedule: list[str], out) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.testing.sync_transports import StageChannel, receive_update
    from srpo_megatron.weights.p2p import receive_stream

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    engine = HFEngine(model)
    channels = [StageChannel("127.0.0.1", p, rank=1, timeout_s=1800) for p in ports]
    extra = []
    for kind in schedule:
        with PeakMemory() as mem:
            if kind == "copy":
                for ch in channels:
                    for _ in receive_stream(ch):
                        pass
                for ch in channels:
                    ch.ack(engine.weight_version)
            else:
                receive_update(engine, channels)
        extra.append(mem.rss_extra)
    out.put({"engine_version": engine.weight_version, "engine_peak_extra_bytes": max(extra)})


def trainer_main(rank, world, config, ports, schedule, bucket_bytes):
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.testing.sync_transports import StageChannel, send_stage, send_stream
    from srpo_megatron.weights.export import is_stage_sender

    groups = initialize_model_parallel(TP, PP, seed=1)
    arch = Architecture.from_hf(config)
    table = ConversionTable(arch)
    with torch.no_grad():
        model = build_policy(arch)
    sender = is_stage_sender(groups)
    channel = StageChannel("127.0.0.1", ports[groups.pp_rank], rank=0, timeout_s=1800) if sender else None
    from srpo_megatron.weights.export import iter_stage_params

    stage_bytes = sum(p.nbytes for p in iter_stage_params(model, table, groups))  # no fetch: no gather
    times = {"sync": [], "copy": []}
    extra = []
    version = 0
    largest = 0
    for kind in schedule:
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "sync":
            version += 1
            with PeakMemory() as mem:
                sent = send_stage(model, table, groups, channel, version, bucket_bytes=bucket_bytes)
            extra.append(mem.rss_extra)
            assert sent in (0, stage_bytes), (sent, stage_bytes)
        else:
            if sender:
                send_stream(channel, plain_stream(stage_bytes, bucket_bytes), 0, bucket_bytes)
                channel.wait_ack()
        dist.barrier()
        times[kind].append(time.perf_counter() - t0)
    if sender:
        largest = max(t.numel() * t.element_size() for _, t in _hf_shapes(table))
    return {"times": times, "bytes": stage_bytes, "peak_extra": max(extra), "largest": largest}


def _hf_shapes(table):
    for h in table.hf_names():
        yield h, torch.empty(table.hf_shape(h), dtype=torch.float32, device="meta")


class StreamingEngine:
    """Engine stand-in for the colocated bench: validates every tensor with the shared gate and copies it
    into its own weight of the same shape (as SGLang loads a bucket), never staging a version."""

    def __init__(
        self, manifest: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype] | None = None
    ) -> None:
        self.manifest = manifest
        # zeros, not empty: the engine's own weights are resident before the measured syncs (untouched
        # pages of torch.empty would be counted as the host rank's sync overhead on their first write)
        dtypes = dtypes or {}
        self.weights = {n: torch.zeros(s, dtype=dtypes.get(n, torch.float32)) for n, s in manifest.items()}
        self.weight_version = 0
        self.bytes = 0

    def update_weights(self, named_tensors, version: int) -> None:
        from srpo_megatron.rollout.gate import check_version, missing_names, validated_stream

        check_version(version, self.weight_version)
        seen: set[str] = set()
        for name, t in validated_stream(named_tensors, self.manifest, seen):
            self.weights[name].copy_(t)
            self.bytes += t.numel() * t.element_size()
        assert not missing_names(self.manifest, seen), missing_names(self.manifest, seen)[:5]
        self.weight_version = version


def fp8_engines(manifest):
    """``--fp8``: a bf16 engine and a blockwise-FP8 engine (weight e4m3 + weight_scale_inv fp32)."""
    from srpo_megatron.conversion.fp8_layout import Fp8Layout
    from srpo_megatron.rollout.served_precision import with_fp8_scales

    layout = Fp8Layout()
    fp8 = with_fp8_scales(manifest, layout)
    kinds = {n: torch.float8_e4m3fn if layout.is_fp8(n) else torch.float32 for n in manifest}
    kinds |= {n: torch.float32 for n in fp8 if n not in manifest}
    bf16 = StreamingEngine(manifest, dict.fromkeys(manifest, torch.bfloat16))
    return {"bf16": bf16, "fp8": StreamingEngine(fp8, {n: kinds.get(n, torch.bfloat16) for n in fp8})}, layout


def colocated_main(rank, world, config, schedule, bucket_bytes, engine_size):
    """TP2xPP2 trainer ranks, one engine per ``engine_size`` ranks hosted in-process (weights.engine_sync).
    Schedule kinds: ``sync`` (export dtype), ``copy`` (plain bytes), ``bf16`` / ``fp8`` (``--fp8``: the
    bf16 sync against the FP8 one, quantizing each FP8-layout weight per 128x128 block on the sender)."""
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rollout.placement import EngineLayout
    from srpo_megatron.testing.sync_transports import send_stream
    from srpo_megatron.weights.engine_sync import sync_engines
    from srpo_megatron.weights.export import iter_stage_params
    from srpo_megatron.weights.p2p import P2PChannel, receive_stream

    groups = initialize_model_parallel(TP, PP, seed=1)
    arch = Architecture.from_hf(config)
    table = ConversionTable(arch)
    with torch.no_grad():
        model = build_policy(arch)
    layout = EngineLayout(world, engine_size)
    host = layout.is_host(rank)
    manifest = {h: table.hf_shape(h) for h in table.hf_names()}  # = hf_manifest of a folder
    engine = StreamingEngine(manifest) if host and "sync" in schedule else None
    precision_engines, fp8_layout = fp8_engines(manifest) if host and "fp8" in schedule else ({}, None)
    times = {"sync": [], "copy": [], "bf16": [], "fp8": []}
    stage_bytes = sum(p.nbytes for p in iter_stage_params(model, table, groups))
    senders = [r for r in range(world) if r % TP == 0]  # TP rank 0 of each stage (DP=1)
    rss, live, version, sent_total = [], [], 0, 0
    for kind in schedule:
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "sync":
            version += 1
            with PeakMemory() as mem:
                sent_total = sync_engines(
                    model, table, groups, engine, version, layout, bucket_bytes=bucket_bytes
                )
            rss.append(mem.rss_extra)
            live.append(mem.live_extra)
        elif kind in ("bf16", "fp8"):  # --fp8: the same policy as bf16, then quantized to FP8 blocks
            version += 1
            sync_engines(
                model,
                table,
                groups,
                precision_engines.get(kind),
                version,
                layout,
                bucket_bytes=bucket_bytes,
                dtype=torch.bfloat16,
                fp8=fp8_layout if kind == "fp8" else None,
            )
        else:  # the same bytes over the same p2p channels (remote hosts) or a local copy (own host)
            for src in senders:
                for h in layout.hosts:
                    if rank == src and h != src:
                        send_stream(
                            P2PChannel(h, groups.host),
                            plain_stream(stage_bytes, bucket_bytes),
                            0,
                            bucket_bytes,
                        )
                    elif rank == h and src != h:
                        for _ in receive_stream(P2PChannel(src, groups.host)):
                            pass
                    elif rank == h == src:
                        for _, t in plain_stream(stage_bytes, bucket_bytes):
                            t.clone()
        dist.barrier()
        times[kind].append(time.perf_counter() - t0)
    largest = max(t.numel() * 4 for _, t in _hf_shapes(table))
    return {
        "times": times,
        "bytes": stage_bytes if rank in senders else 0,
        "rss_extra": rss,
        "live_extra": live,
        "largest": largest,
        "host": host,
        "engine_bytes": engine.bytes if engine is not None else 0,
        "engine_version": engine.weight_version if engine is not None else None,
        "precision_bytes": {k: e.bytes for k, e in precision_engines.items()},
        "sent_remote": sent_total,
    }


def main_colocated(args, config, bucket_bytes) -> None:
    from srpo_megatron.local_ranks import run_distributed

    # A warm-up copy (first use of the channels), then sync/copy pairs: each pair's ratio is measured
    # under the same load, and the median pair is reported.
    schedule = ["copy"] + ["sync", "copy"] * args.repeats
    load_before = os.getloadavg()
    ranks = run_distributed(
        colocated_main, TP * PP, config, schedule, bucket_bytes, args.gpus_per_engine, timeout=3600
    )
    load_after = os.getloadavg()
    total = sum(r["bytes"] for r in ranks)
    hosts = [r for r in ranks if r["host"]]
    sync_s = [max(r["times"]["sync"][k] for r in ranks) for k in range(args.repeats)]
    copy_s = [max(r["times"]["copy"][k + 1] for r in ranks) for k in range(args.repeats)]
    ratios = [c / s for c, s in zip(copy_s, sync_s, strict=True)]
    rss = [max(r["rss_extra"]) for r in ranks]  # per rank, worst sync
    live = [max(r["live_extra"]) for r in ranks]
    largest = max(r["largest"] for r in ranks)
    bound = bucket_bytes + largest
    ratio = statistics.median(ratios)
    print(f"model bytes (HF, fp32): {total / 1e9:.2f} GB into {len(hosts)} engines (TP{TP}xPP{PP} trainer)")
    print(
        f"engines serve versions {[r['engine_version'] for r in hosts]}, each received "
        f"{[round(r['engine_bytes'] / args.repeats / 1e9, 2) for r in hosts]} GB per sync"
    )
    print(f"load average (1 min) before / after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    print(f"sync (gather+convert+transfer+load, all engines), per pair: {[round(t, 2) for t in sync_s]} s")
    print(f"plain copy of the same bytes, same channels, per pair:      {[round(t, 2) for t in copy_s]} s")
    print(f"throughput vs copy per pair {[round(r, 2) for r in ratios]}, median {ratio:.2f} (goal >= 0.5)")
    print(
        f"peak extra memory per rank, worst sync (bound: bucket {bucket_bytes / 1e6:.0f} MB + largest tensor "
        f"{largest / 1e6:.0f} MB = {bound / 1e6:.0f} MB): resident {[round(m / 1e6) for m in rss]} MB, "
        f"live allocations {[round(m / 1e6) for m in live]} MB"
    )
    print(
        json.dumps(
            {
                "placement": "colocated",
                "engines": len(hosts),
                "model_bytes": total,
                "sync_s": [round(t, 3) for t in sync_s],
                "copy_s": [round(t, 3) for t in copy_s],
                "throughput_vs_copy": round(ratio, 3),
                "throughput_met": ratio >= 0.5,
                "loadavg_1m": [round(load_before[0], 2), round(load_after[0], 2)],
                "peak_extra_rss_bytes": rss,
                "peak_extra_live_bytes": live,
                "bound_bytes": bound,
                "memory_met": max(rss) <= bound,
            }
        )
    )


def main_fp8(args, config, bucket_bytes) -> None:
    """``--fp8``: bf16 sync vs FP8 sync (quantize + send) of the same policy, alternating, same run."""
    from srpo_megatron.local_ranks import run_distributed

    schedule = ["bf16"] + ["bf16", "fp8"] * args.repeats  # a warm-up bf16 sync, then pairs
    ranks = run_distributed(
        colocated_main, TP * PP, config, schedule, bucket_bytes, args.gpus_per_engine, timeout=3600
    )
    bf16_s = [max(r["times"]["bf16"][k + 1] for r in ranks) for k in range(args.repeats)]
    fp8_s = [max(r["times"]["fp8"][k] for r in ranks) for k in range(args.repeats)]
    ratios = [b / f for b, f in zip(bf16_s, fp8_s, strict=True)]
    ratio = statistics.median(ratios)
    got = [r["precision_bytes"] for r in ranks if r["host"]]
    print(f"bytes received per host engine (all syncs): {got}")
    print(
        f"bf16 sync per pair: {[round(t, 2) for t in bf16_s]} s; "
        f"fp8 sync (quantize + send): {[round(t, 2) for t in fp8_s]} s"
    )
    print(
        f"fp8 throughput vs bf16 per pair {[round(r, 2) for r in ratios]}, median {ratio:.2f} (goal >= 0.5)"
    )
    result = {"placement": "colocated", "row": "fp8", "bf16_sync_s": [round(t, 3) for t in bf16_s]}
    result |= {
        "fp8_sync_s": [round(t, 3) for t in fp8_s],
        "fp8_vs_bf16": round(ratio, 3),
        "fp8_met": ratio >= 0.5,
    }
    print(json.dumps(result))


LORA_MODELS = {  # besides the benchmark's own model (hub config.json fields the tables read)
    "tiny_qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=151669, tie_word_embeddings=False,
    ),
    "qwen3_8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


def main_lora(args, config) -> None:
    """Adapter-sync bytes against full-weight-sync bytes (bf16 both), counted from the conversion tables."""
    from srpo_megatron.config.lora import LoraConfig
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.weights.lora_sync import sync_bytes

    result = {"lora_rank": args.lora_rank, "models": {}}
    for name, cfg in {"bench": config, **LORA_MODELS}.items():
        b = sync_bytes(Architecture.from_hf(cfg), LoraConfig(rank=args.lora_rank))
        print(f"{name:12s} adapter sync {b.adapter / 1e6:9.2f} MB  full sync {b.full / 1e6:10.2f} MB  "
              f"ratio full/adapter {1 / b.ratio:7.1f}")  # fmt: skip
        result["models"][name] = {
            "adapter_bytes": b.adapter,
            "full_bytes": b.full,
            "ratio": round(1 / b.ratio, 1),
        }
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--placement", choices=["colocated", "separate"], default="colocated")
    ap.add_argument("--gpus-per-engine", type=int, default=2, help="colocated: trainer ranks per engine")
    ap.add_argument("--fp8", action="store_true", help="colocated: the FP8 row (bf16 sync vs FP8 sync)")
    ap.add_argument("--lora-rank", type=int, default=0, help="the LoRA row: adapter vs full sync bytes")
    args = ap.parse_args()
    if args.lora_rank:
        return main_lora(args, hf_config(args))
    if args.fp8:
        return main_fp8(args, hf_config(args), args.bucket_mb * 1024**2)
    if args.placement == "colocated":
        return main_colocated(args, hf_config(args), args.bucket_mb * 1024**2)

    from srpo_megatron.local_ranks import run_distributed
    from srpo_megatron.ports import free_port

    config = hf_config(args)
    bucket_bytes = args.bucket_mb * 1024**2
    # copy first as a warm-up of the channels, then alternate so drift hits both alike
    schedule = ["copy", "sync"] * args.repeats
    ports = [free_port() for _ in range(PP)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    engine = ctx.Process(target=engine_main, args=(config, ports, schedule, q))
    engine.start()
    try:
        ranks = run_distributed(trainer_main, TP * PP, config, ports, schedule, bucket_bytes, timeout=3600)
        eng = q.get(timeout=600)
    finally:
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()

    total = sum(r["bytes"] for r in ranks)
    sync_s = min(max(r["times"]["sync"][k] for r in ranks) for k in range(args.repeats))
    copy_s = min(max(r["times"]["copy"][k] for r in ranks) for k in range(args.repeats))
    peak = max(r["peak_extra"] for r in ranks)
    largest = max(r["largest"] for r in ranks)
    print(f"model bytes (HF, fp32): {total / 1e9:.2f} GB; engine serves version {eng['engine_version']}")
    print(f"sync (reshard+transfer+install): {sync_s:.2f} s = {total / sync_s / 1e9:.2f} GB/s")
    print(f"plain copy of the same bytes:    {copy_s:.2f} s = {total / copy_s / 1e9:.2f} GB/s")
    print(
        f"peak extra memory, worst trainer rank: {peak / 1e6:.0f} MB (bucket {bucket_bytes / 1e6:.0f} MB + "
        f"largest tensor {largest / 1e6:.0f} MB = {(bucket_bytes + largest) / 1e6:.0f} MB bound)"
    )
    engine_mb = eng["engine_peak_extra_bytes"] / 1e6
    print(f"engine process peak extra memory: {engine_mb:.0f} MB (stages one version)")
    result = {
        "model_bytes": total,
        "sync_s": round(sync_s, 3),
        "copy_s": round(copy_s, 3),
        "throughput_vs_copy": round(copy_s / sync_s, 3),
        "peak_extra_mem_bytes": peak,
        "bucket_bytes": bucket_bytes,
        "largest_tensor_bytes": largest,
        "engine_peak_extra_bytes": eng["engine_peak_extra_bytes"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
