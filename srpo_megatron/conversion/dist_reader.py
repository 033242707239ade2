"""Read regions of a megatron-core ``torch_dist`` checkpoint one stored chunk at a time.

``dist_checkpointing.load`` fills a whole state dict at once, so exporting a model through it holds the
model in memory. ``TorchDistReader.read(key, offset, shape)`` returns one region of one tensor, built
from only the stored chunks that overlap it, each read with ``torch.load`` from its byte range of the
``.distcp`` file, as torch DCP's ``FileSystemReader.read_data`` reads it (``weights_only=True``, CPU), or,
when the chunk is byte for byte torch's envelope around raw data (``stream_writer`` output), as a view of
its bytes of the file, mapped. Peak memory is the region plus one stored chunk.

Coordinates are the checkpoint's global ones: a ShardedTensor with ``prepend_axis_num`` p stores chunks of
shape ``(1,) * p + local_shape`` at ``global_offset`` (see ``stream_writer``). A region the stored chunks
do not cover (rows of a vocab padded further than the checkpoint's, ``allow_shape_mismatch``) is zeros,
like megatron's resharding leaves them.
"""

from __future__ import annotations

import io
import math
import mmap
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from srpo_megatron.conversion.torch_save_format import TorchSaveEnvelopes


class _Window(io.RawIOBase):
    """``[offset, offset + length)`` of an open file as a seekable stream of its own (for torch.load)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")[: self._len - self._pos]
        self._f.seek(self._start + self._pos)
        n = self._f.readinto(view)
        self._pos += n
        return n


class TorchDistReader:
    """Tensor regions of a torch_dist checkpoint directory, read chunk by chunk."""

    def __init__(self, ckpt_dir: str | Path):
        self.dir = Path(ckpt_dir)
        self.metadata = FileSystemReader(str(self.dir)).read_metadata()
        self._files: dict[str, object] = {}
        self._chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        self._envelopes = TorchSaveEnvelopes()

    def tensor_metadata(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.dir}: no tensor {key!r} in the checkpoint")
        return md

    def read(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Region ``[offset, offset + shape)`` of tensor ``key`` (the stored dtype)."""
        md = self.tensor_metadata(key)
        offset, shape = tuple(offset), tuple(shape)
        if key not in self._chunks:  # per key: stored chunk by offset (MoE keys have thousands)
            self._chunks[key] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        chunks = self._chunks[key]
        if chunks.get(offset) == shape:
            return self._load(key, offset, shape)  # the common case: the region is one stored chunk
        out = torch.zeros(shape, dtype=md.properties.dtype)
        for c_off, c_size in chunks.items():
            lo = [max(a, b) for a, b in zip(offset, c_off, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, c_off, c_size, strict=True)]
            if any(x >= y for x, y in zip(lo, hi, strict=True)):
                continue
            stored = self._load(key, c_off, c_size)
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, c_off, strict=True))
            out[dst] = stored[src]
        return out

    def _load(self, key: str, offset: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        info = self.metadata.storage_data[MetadataIndex(key, torch.Size(offset))]
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(
                f"{self.dir}: {key} is stored with transforms {info.transform_descriptors}; "
                "export it with dist_checkpointing.load instead"
            )
        f = self._files.get(info.relative_path)
        if f is None:
            f = self._files[info.relative_path] = open(self.dir / info.relative_path, "rb")  # noqa: SIM115
        dtype = self.metadata.state_dict_metadata[key].properties.dtype
        tensor = self._load_spliced(f, info.offset, info.length, dtype, sizes)
        if tensor is None:
            tensor = torch.load(_Window(f, info.offset, info.length), map_location="cpu", weights_only=True)
        if tuple(tensor.shape) != sizes:
            raise ValueError(
                f"{self.dir}: stored chunk {key} at {offset} has shape {tuple(tensor.shape)}, "
                f"its metadata says {sizes}"
            )
        return tensor

    def _load_spliced(
        self, f, offset: int, length: int, dtype, sizes: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The chunk at ``[offset, offset + length)`` when its bytes are the torch.save envelope of a
        ``dtype`` tensor of ``sizes`` around its raw data (what ``stream_writer`` writes, CRC32s off): a
        view of those bytes of the file, mapped copy-on-write (no read, no copy; the map goes with the
        tensor); else None (e.g. CRCs on, as megatron's own save writes them), and the caller runs
        ``torch.load``.

        Exactly what torch.load returns: the envelope is payload-independent and torch's own
        (``torch_save_format``), and prefix and suffix are compared byte for byte, so a chunk that
        matches decodes to this dtype, shape and contiguous layout, with these bytes as its data.
        ``torch.load`` costs ~1 ms of zip and unpickler work per chunk (seconds for an MoE's thousands)
        and copies the data into fresh memory."""
        env = self._envelopes.get(dtype, sizes)
        if env is None:
            return None
        prefix, suffix = env
        count = math.prod(sizes)
        start, nbytes = offset + len(prefix), count * dtype.itemsize
        if length != len(prefix) + nbytes + len(suffix):
            return None
        fd = f.fileno()
        if os.pread(fd, len(prefix), offset) != prefix or os.pread(fd, len(suffix), start + nbytes) != suffix:
            return None
        base = start - start % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(fd, start + nbytes - base, access=mmap.ACCESS_COPY, offset=base)
        return torch.frombuffer(region, dtype=dtype, count=count, offset=start - base).view(sizes)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


__all__ = ["TorchDistReader"]
