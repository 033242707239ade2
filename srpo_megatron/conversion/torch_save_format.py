"""``torch.save`` bytes of a tensor without building the tensor: envelope + raw data, spliced.

With CRC32s off (``torch.serialization.set_crc32_options(False)``, as the streamed checkpoint writer sets
them), ``torch.save(t)`` of a contiguous tensor that owns exactly its storage is

    prefix(dtype, shape) + t's row-major bytes + suffix(dtype, shape)

(a zip archive: ``data.pkl`` with the shape/stride/dtype, the storage record ``data/0`` aligned to 64
bytes, ``version``, ``byteorder``, the central directory). ``TorchSaveEnvelopes`` obtains prefix and
suffix from torch itself, once per (dtype, shape): it saves an untouched ``torch.empty`` stand-in into a
sink that keeps every write except the storage payload, recognised as the single write of the stand-in's
own memory. A writer can then emit the payload from any source, e.g. several pieces read straight from
mmapped safetensors, with no full tensor allocated, no copy, and one or two ``write`` calls instead of
torch.save's ~40 per tensor (what made thousands of small MoE expert tensors slow).

Nothing is assumed about the zip layout; only that it does not depend on the payload bytes when CRCs are
off. ``tests/unit/test_torch_save_format.py`` checks spliced bytes == ``torch.save`` bytes for several
dtypes and shapes, and fails if a torch release makes the envelope data-dependent or stops passing the
payload as one write (``envelope`` then answers None and callers fall back to plain ``torch.save``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def crc32_off() -> Iterator[None]:
    """``torch.save`` without its per-record zip CRC32s inside the block (the caller's setting after it).
    torch.load and torch DCP's reader do not check them (torch's ``set_crc32_options`` docs), and every
    file we write is covered by the manifest's SHA-256 or the converter's own check, so they are a second
    checksum that costs CPU on every byte; forked writers started inside the block inherit the setting."""
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(crc32)


class _Sink:
    """File-like object for ``torch.save``: keeps the bytes of every write except the payload's."""

    def __init__(self, payload_ptr: int, payload_nbytes: int):
        self.ptr, self.nbytes = payload_ptr, payload_nbytes
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.seen = 0  # writes recognised as the payload

    def write(self, data) -> int:
        view = memoryview(data)
        if view.nbytes == self.nbytes and np.frombuffer(view, np.uint8).ctypes.data == self.ptr:
            self.seen += 1
        else:
            (self.after if self.seen else self.before).append(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        pass


def envelope(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """(prefix, suffix) of ``torch.save`` of a contiguous ``dtype`` tensor of ``shape`` owning its storage,
    or None when torch did not write the payload as exactly one write (callers then use torch.save)."""
    if torch.serialization.get_crc32_options():
        raise RuntimeError("torch.save envelopes are payload-independent only with CRC32s off")
    stub = torch.empty(shape, dtype=dtype)  # never written or read: its pages are never touched
    if stub.nbytes == 0:
        return None
    sink = _Sink(stub.data_ptr(), stub.nbytes)
    torch.save(stub, sink)
    if sink.seen != 1:
        return None
    return b"".join(sink.before), b"".join(sink.after)


class TorchSaveEnvelopes:
    """Cache of :func:`envelope` per (dtype, shape): a model has a few dozen distinct chunk shapes."""

    def __init__(self) -> None:
        self._cache: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, bytes] | None] = {}

    def get(self, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
        """The envelope of torch.save with CRC32s off (whatever the caller's setting is)."""
        key = (dtype, tuple(shape))
        if key not in self._cache:
            with crc32_off():
                self._cache[key] = envelope(dtype, key[1])
        return self._cache[key]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Row-major bytes of a contiguous CPU tensor, without a copy (bf16 included, as raw bytes)."""
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


__all__ = ["TorchSaveEnvelopes", "envelope", "tensor_bytes"]
