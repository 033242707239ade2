"""Colocated SGLang sync at engine TP 2: each engine TP rank's payload is made on its own GPU.

SGLang's scheduler rank i deserializes ``serialized_named_tensors[i]`` (``TpModelWorker``); the tensor in
it must live on GPU i. The tiny Qwen3 policy runs at TP 2 in strict-device mode (a tensor put on the
device reports ``cuda:<LOCAL_RANK>``), one engine spans both ranks (``EngineLayout(2, 2)``), and the
serializer records, for each payload it makes, the rank that made it, the device its flat tensor is on,
its address and a digest of its bytes. Every request must carry entry i from rank i on ``cuda:i`` with
the host's bytes; the host's entry must be the trainer's own flat bucket (one copy).

Planted: version 2 runs with the old behaviour (the host's payload copied to every TP rank); the same
check must reject it.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.strict_device


def _recording_serialize(data):
    import hashlib
    import json

    import torch.distributed as dist

    flat = data["flattened_tensor"]
    return json.dumps(
        {
            "rank": dist.get_rank(),
            "device": str(flat.device),
            "ptr": flat.data_ptr(),
            "sha": hashlib.sha256(bytes(flat.detach().cpu().numpy())).hexdigest(),
            "names": [m.name for m in data["metadata"]],
        }
    )


class _Recorder:
    """The SGLang transport of the host: records every request body, answers success."""

    def __init__(self):
        self.bodies = []

    def call(self, method, body=None, http_method="POST"):
        self.bodies.append((method, body))
        return {"success": True, "message": ""}

    def health(self):
        return True

    def close(self):
        pass


def _worker(rank, world, folder):
    import json

    from srpo_megatron import buckets
    from srpo_megatron.config import SGLangEngineConfig
    from srpo_megatron.conversion.manifest import hf_manifest
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rollout.placement import EngineLayout
    from srpo_megatron.rollout.sglang import flat_wire
    from srpo_megatron.rollout.sglang.engine import SGLangEngine
    from srpo_megatron.rollout.sglang.protocol import flat_bucket_data
    from srpo_megatron.testing.strict_device import strict_device
    from srpo_megatron.weights import engine_sync, tp_payloads

    flat_wire.serialize = _recording_serialize  # what every rank serializes with when SGLang is absent
    made = []  # the host's flat buckets, as flat_buckets built them
    real_flat_buckets = buckets.flat_buckets

    def recording_flat_buckets(*args, **kwargs):
        for b in real_flat_buckets(*args, **kwargs):
            made.append((b.flat.data_ptr(), [s.name for s in b.specs]))
            yield b

    engine_sync.flat_buckets = recording_flat_buckets
    with strict_device():
        groups = initialize_model_parallel(2, 1, seed=1)
        arch = Architecture.from_hf(folder)
        model = build_policy(arch).to(groups.device)  # strict mode: the parameters are device tensors
        engine = None
        if rank == 0:
            cfg = SGLangEngineConfig(model_path=folder, engine_kwargs={"tp_size": 2})
            engine = SGLangEngine(cfg, transport=_Recorder(), manifest=hf_manifest(folder))
        layout = EngineLayout(2, 2)
        args = (model, ConversionTable(arch), groups, engine)
        engine_sync.sync_engines(*args, 1, layout, bucket_bytes=64 * 1024, tp_payloads=True)
        if rank == 0:  # the planted old behaviour: the host's own payload for every TP rank
            real = tp_payloads.EnginePeers.payloads

            def copied(self, bucket, version):
                real(self, bucket, version)  # the peers still take their part of the protocol
                own = flat_wire.serialize(flat_bucket_data(bucket))
                return [own] * (self.tp_size - 1)

            tp_payloads.EnginePeers.payloads = copied
        engine_sync.sync_engines(*args, 2, layout, bucket_bytes=64 * 1024, tp_payloads=True)
    if rank != 0:
        return None
    sent = [
        (int(b["weight_version"]), [json.loads(p) for p in b["serialized_named_tensors"]])
        for m, b in engine._transport.bodies
        if m == "update_weights_from_tensor"
    ]
    return {"sent": sent, "made": made, "version": engine.weight_version}


def check_own_rank_payloads(requests, made=None):
    """Every request: entry i made by rank i from a tensor on ``cuda:i``, every entry the same bytes and
    names; with ``made``: entry 0 is the trainer's flat bucket itself (its address)."""
    assert requests, "no update_weights_from_tensor request was sent"
    for k, entries in enumerate(requests):
        assert [e["rank"] for e in entries] == list(range(len(entries))), (k, entries)
        assert [e["device"] for e in entries] == [f"cuda:{i}" for i in range(len(entries))], (k, entries)
        assert len({e["sha"] for e in entries}) == 1 and len({tuple(e["names"]) for e in entries}) == 1
        if made is not None:
            assert entries[0]["ptr"] == made[k][0] and entries[0]["names"] == made[k][1]


def test_each_engine_tp_rank_gets_a_payload_of_its_own_gpu(tmp_path):
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    folder = str(write_tiny_qwen3(tmp_path / "tiny"))
    out = run_distributed(_worker, 2, folder, timeout=600)[0]
    assert out["version"] == 2
    v1 = [entries for v, entries in out["sent"] if v == 1]
    v2 = [entries for v, entries in out["sent"] if v == 2]
    assert len(v1) > 1 and len(v2) == len(v1)  # several buckets, each to both TP ranks
    check_own_rank_payloads(v1, out["made"][: len(v1)])  # one copy: entry 0 IS the trainer's bucket
    with pytest.raises(AssertionError):  # planted: the host's payload copied to rank 1 (GPU 0 mapped twice)
        check_own_rank_payloads(v2)
