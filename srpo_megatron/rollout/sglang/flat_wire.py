"""SGLang's flattened-bucket payload, written and read without SGLang (CPU machines, the stand-in server).

What SGLang sends and reads for ``update_weights_from_tensor(load_format="flattened_bucket")``, as its
``FlattenedTensorBucket`` and ``MultiprocessingSerializer`` (sglang/srt/weight_sync/tensor_bucket.py,
sglang/srt/utils/common.py, 0.5.15.post1 .. 0.5.23) make it: one string per scheduler TP rank, each

    base64( ForkingPickler.dumps({"flattened_tensor": uint8 [bytes], "metadata": [FlattenedTensorMetadata]}) )

where the tensors are concatenated as raw bytes without padding and each metadata entry is SGLang's
dataclass ``FlattenedTensorMetadata(name, shape: torch.Size, dtype: torch.dtype, start_idx, end_idx,
numel)`` (byte offsets). SGLang's scheduler reads the entries by attribute and its unpickler only admits
its own metadata class (``SafeUnpickler``), so a payload with any other metadata (tuples, dtype strings)
is refused. ``protocol.serialize_bucket_per_tp_rank`` uses SGLang's own classes whenever they import and
this writer otherwise; tests/sglang_real checks that both give the same payload (same pickled globals,
same metadata, same bytes) and that SGLang's classes decode this writer's strings.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
SGLANG_METADATA_CLASS = "FlattenedTensorMetadata"


@dataclass
class FlattenedTensorMetadata:
    """SGLang's ``FlattenedTensorMetadata``, field for field (pickled under SGLang's name)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flatten(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """SGLang's layout: each tensor's bytes back to back (``FlattenedTensorBucket(named_tensors=...)``)."""
    if not bucket:
        raise ValueError("cannot flatten an empty bucket (SGLang refuses one too)")
    parts, meta, offset = [], [], 0
    for name, t in bucket:
        flat = t.detach().flatten().view(torch.uint8)
        parts.append(flat)
        meta.append(
            FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + flat.numel(), flat.numel())
        )
        offset += flat.numel()
    return torch.cat(parts), meta


class _WirePickler(pickle._Pickler):  # the Python pickler: it lets one global be written by name
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=4)
        self.dispatch_table = ForkingPickler(io.BytesIO()).dispatch_table  # torch's tensor reducers

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:  # SGLang's class, which its unpickler admits, not ours
            self.save(SGLANG_METADATA_MODULE)
            self.save(SGLANG_METADATA_CLASS)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def serialize(obj: Any) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)`` (ForkingPickler + base64)."""
    buf = io.BytesIO()
    _WirePickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def encode(bucket: Sequence[tuple[str, torch.Tensor]], tp_size: int) -> tuple[list[str], torch.Tensor]:
    """One payload per scheduler TP rank, and the flat tensor they share (keep it alive until answered)."""
    flat, meta = flatten(bucket)
    data = {"flattened_tensor": flat, "metadata": meta}
    return [serialize(data) for _ in range(tp_size)], flat


class _WireUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (SGLANG_METADATA_MODULE, SGLANG_METADATA_CLASS):
            return FlattenedTensorMetadata
        return super().find_class(module, name)


def decode(payload: str) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's payload back to named tensors (``deserialize`` + ``reconstruct_tensors``). Like
    SGLang's, each string can be decoded once: the tensor's memory travels as a shared file descriptor."""
    data = _WireUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    flat = data["flattened_tensor"]
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in data["metadata"]]
