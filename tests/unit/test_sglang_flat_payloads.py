"""The SGLang engine sends the trainer's flat bucket itself: one copy of the weights, not two.

``SGLangEngine.update_weight_buckets`` gets ``buckets.FlatBucket``s (the buffers the trainer's gathers wrote
into) and each ``update_weights_from_tensor`` payload's ``flattened_tensor`` is that buffer: same storage,
same address. The payload still decodes (``flat_wire``, SGLang's wire format) to the exact tensors.
Planted: the old path (``FlattenedTensorBucket(named_tensors=...)``, i.e. ``torch.cat`` of the bucket's
views into a new buffer) makes the check fail.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.buckets import FlatBucket, TensorSpec
from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.sglang import engine as engine_mod
from srpo_megatron.rollout.sglang import flat_wire, protocol
from srpo_megatron.rollout.sglang.engine import SGLangEngine

SHAPES = {"a.weight": (3, 5), "b.weight": (7,), "c.bias": (2, 2)}


class _Recorder:
    def __init__(self):
        self.bodies = []

    def call(self, method, body=None, http_method="POST"):
        self.bodies.append((method, body))
        return {"success": True, "message": ""}

    def health(self):
        return True

    def close(self):
        pass


def _bucket(dtype=torch.bfloat16) -> tuple[FlatBucket, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    want = {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}
    bucket = FlatBucket.empty([TensorSpec(n, dtype, s) for n, s in SHAPES.items()])
    for (_, view), t in zip(bucket.views(), want.values(), strict=True):
        view.copy_(t)
    return bucket, want


def _sync(bucket: FlatBucket, tp: int = 2) -> tuple[list[torch.Tensor], list[str]]:
    seen: list[torch.Tensor] = []

    def serializer(data):
        seen.append(data["flattened_tensor"])
        return flat_wire.serialize(data)

    cfg = SGLangEngineConfig(model_path="unused", engine_kwargs={"tp_size": tp})
    eng = SGLangEngine(cfg, transport=_Recorder(), manifest=dict(SHAPES), serializer=serializer)
    eng.update_weight_buckets([bucket], 1)
    assert eng.weight_version == 1
    (body,) = [b for m, b in eng._transport.bodies if m == "update_weights_from_tensor"]
    return seen, body["serialized_named_tensors"]


def check_one_copy(bucket: FlatBucket, seen: list[torch.Tensor]) -> None:
    for flat in seen:
        assert flat.data_ptr() == bucket.flat.data_ptr(), "the payload holds a second copy of the bucket"
        assert flat.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()


def test_the_payload_is_the_trainers_flat_bucket_and_decodes_exactly():
    bucket, want = _bucket()
    seen, payloads = _sync(bucket)
    check_one_copy(bucket, seen)
    assert len(payloads) == 2
    for payload in payloads:  # every entry decodes to the exact tensors (float64 compare, bitwise)
        got = dict(flat_wire.decode(payload))
        assert list(got) == list(want)
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name].double(), t.double())


def test_planted_second_copy_is_caught(monkeypatch):
    """The old path: the bucket's tensors flattened again into a new buffer (``torch.cat``)."""

    def copied(bucket):
        flat, metadata = flat_wire.flatten(bucket.views())
        return {"flattened_tensor": flat, "metadata": metadata}

    monkeypatch.setattr(engine_mod, "flat_bucket_data", copied)
    bucket, _ = _bucket()
    seen, _ = _sync(bucket)
    with pytest.raises(AssertionError, match="second copy"):
        check_one_copy(bucket, seen)


def test_flat_bucket_data_keeps_alignment_gaps_as_offsets():
    """FlatBucket aligns each tensor at 256 bytes: SGLang's metadata carries each start/end, so the gaps
    stay in the buffer and every entry starts where the bucket put it."""
    bucket, _ = _bucket(torch.float32)
    data = protocol.flat_bucket_data(bucket)
    assert [m.start_idx for m in data["metadata"]] == bucket.offsets
    assert [m.end_idx - m.start_idx for m in data["metadata"]] == [s.nbytes for s in bucket.specs]
