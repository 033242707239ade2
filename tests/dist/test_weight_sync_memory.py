"""Colocated weight sync (``weights.engine_sync``) at TP2xPP2 into two engines: each rank holds at most ONE
bucket buffer at any time, and the engines receive the HF tensors bit-exact (fp32 and cast to bf16).

Counting: every flat bucket buffer (``FlatBucket.empty`` on the stage senders, ``FlatBucket.from_meta``
on the receiving hosts) gets a finalizer on its storage, so a buffer counts as alive while any view of it
exists anywhere, the engine's loop variable included; the count is read whenever a buffer is made and
whenever the engine receives a tensor. The check can fail: handing the last tensor of a bucket to the
engine as a view (planted) keeps that bucket alive while the next one is built, and two are alive.

Exactness covers each way a shard reaches the bucket (``weights.export._fetch``): received in place
(gated fc1 runs, row-parallel columns), via a temporary full tensor (the per-group QKV split, the
vocab-padded embedding, the bf16 cast), and unsharded (norms); shards travel point-to-point (gloo) or by
``dist.gather`` (what NCCL uses, run here on gloo).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_hf_model

TP, PP = 2, 2
BUCKET_BYTES = 32 * 1024  # several buckets per stage; the embedding goes alone


class LiveBuckets:
    """Flat bucket buffers that are still alive (some view of their storage exists)."""

    def __init__(self) -> None:
        self.alive: dict[int, int] = {}  # id -> bytes
        self.max_alive = 0
        self.made = 0

    def track(self, bucket):
        key = self.made
        self.made += 1
        self.alive[key] = bucket.flat.numel()
        weakref.finalize(bucket.flat.untyped_storage(), self.alive.pop, key, None)
        self.check()
        return bucket

    def check(self) -> None:
        self.max_alive = max(self.max_alive, len(self.alive))


class RecordingEngine:
    """Engine stand-in: copies each tensor it receives (as an engine installs it), counting buffers."""

    def __init__(self, live: LiveBuckets) -> None:
        self.live, self.got, self.weight_version = live, {}, 0

    def update_weights(self, named_tensors, version: int) -> None:
        for name, t in named_tensors:
            self.live.check()
            assert name not in self.got, f"{name} sent twice"
            self.got[name] = t.clone()
        self.weight_version = version


def colocated_worker(rank, world, hf_config, state, dtype, plant):
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rollout.placement import EngineLayout
    from srpo_megatron import buckets
    from srpo_megatron.weights import engine_sync, export, p2p

    groups = initialize_model_parallel(TP, PP, seed=1)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch)
    load_hf_weights(model, table, state.__getitem__)

    live = LiveBuckets()
    empty, from_meta = buckets.FlatBucket.empty, buckets.FlatBucket.from_meta
    buckets.FlatBucket.empty = lambda specs, device="cpu": live.track(empty(specs, device))
    buckets.FlatBucket.from_meta = lambda meta, device="cpu": live.track(from_meta(meta, device))
    if plant == "last_tensor_as_view":
        engine_sync.streamed_views = p2p.streamed_views = lambda b: iter(b.views())
    if plant == "gather":  # the path NCCL takes (dist.gather), run on gloo
        export._point_to_point = lambda groups: False
    layout = EngineLayout(world, 2)
    engine = RecordingEngine(live) if layout.is_host(rank) else None
    engine_sync.sync_engines(model, table, groups, engine, 1, layout, bucket_bytes=BUCKET_BYTES, dtype=dtype)
    return {"max_alive": live.max_alive, "made": live.made, "got": engine.got if engine else None}


def _run(dtype, plant=None):
    source = tiny_hf_model("llama", seed=3)
    state = {k: v.detach().clone() for k, v in source.state_dict().items()}
    config = source.config.to_dict()
    return state, run_distributed(colocated_worker, TP * PP, config, state, dtype, plant, timeout=600)


@pytest.mark.parametrize(
    "dtype, path",
    [(None, None), (torch.bfloat16, None), (None, "gather")],
    ids=["fp32-p2p", "bf16-p2p", "fp32-gather"],
)
def test_colocated_sync_holds_one_bucket_per_rank_and_is_bit_exact(dtype, path):
    state, ranks = _run(dtype, path)
    want = {k: v if dtype is None else v.to(dtype) for k, v in state.items() if k != "lm_head.weight"}
    hosts = [r for r in ranks if r["got"] is not None]
    assert len(hosts) == 2
    for r in hosts:
        assert sorted(r["got"]) == sorted(want)
        for name, t in want.items():
            assert r["got"][name].dtype == t.dtype and torch.equal(r["got"][name], t), name
    # Senders built several buckets and hosts received several: the count below is not vacuous.
    assert all(r["made"] >= 4 for r in hosts), [r["made"] for r in ranks]
    assert max(r["max_alive"] for r in ranks) == 1, [r["max_alive"] for r in ranks]


def test_the_bucket_count_catches_a_bucket_kept_alive_by_the_engine():
    _, ranks = _run(None, plant="last_tensor_as_view")
    assert max(r["max_alive"] for r in ranks) >= 2, [r["max_alive"] for r in ranks]


def test_flat_buckets_plan_before_fetching_align_slots_and_send_an_oversized_parameter_alone():
    """Hand-worked, 1024-byte buckets: parameters of 100, 600, 300, 2000 and 40 bytes (fp32) take
    256-byte aligned slots of 256, 768, 512, 2048 and 256 bytes, so the buckets are [p0, p1], [p2],
    [p3] (alone, over the bound) and [p4]; each bucket is built (its parameters fetched) only after
    the previous one was handed out, and every tensor arrives intact at its slot."""
    from srpo_megatron.buckets import ALIGN, PendingParam, TensorSpec, flat_buckets, streamed_views

    log = []
    sizes = [100, 600, 300, 2000, 40]

    def value(k):
        return torch.arange(sizes[k] // 4, dtype=torch.float32) + 1000 * k

    def fetch_into(k, out):
        log.append(f"fetch{k}")
        out[0].copy_(value(k))

    pending = [
        PendingParam(
            f"p{k}",
            n,
            None,
            (TensorSpec(f"p{k}", torch.float32, (n // 4,)),),
            lambda o, k=k: fetch_into(k, o),
        )
        for k, n in enumerate(sizes)
    ]
    got = {}
    for bucket in flat_buckets(pending, bucket_bytes=1024):
        assert all(o % ALIGN == 0 for o in bucket.offsets)
        log.append(f"send {bucket.flat.numel()}")
        got.update(streamed_views(bucket))
    assert log == [
        "fetch0",
        "fetch1",
        "send 1024",
        "fetch2",
        "send 512",
        "fetch3",
        "send 2048",
        "fetch4",
        "send 256",
    ]
    for k in range(len(sizes)):
        assert torch.equal(got[f"p{k}"], value(k))
