"""SHA-256 of dist_checkpointing's data files taken while megatron's writers write them.

A checkpoint's manifest holds the size and SHA-256 of every file (``conversion/checkpoint_files.py``).
Reading the data files back after the save to hash them cost about a third of the fast default save
(``tools/bench_checkpoint.py``); here the bytes are hashed on their way to the file instead, by the
processes that write them, so each rank digests only what it wrote, in parallel, and nothing is read back.

How: megatron-core's torch_dist save (``TorchDistSaveShardedStrategy`` -> ``FileSystemWriterAsync``,
megatron-core 0.16.1 and 0.19.2 ``dist_checkpointing/strategies/{torch,filesystem_async}.py``) forks
writer processes that write every item through torch DCP's ``_write_item``, which writes through
``writer.transforms.transform_save_stream(item, file)`` (torch 2.13
``distributed/checkpoint/filesystem.py``). :class:`HashingTransforms` puts one SHA-256 per file under
that stream, before torch's own wrappers and any extension, so it sees exactly the bytes that reach the
file; after each item the digest and byte count go to a shared-memory slot the forked writer inherits. It
adds no transform descriptor, so the checkpoint's ``.metadata`` records no extension and any torch_dist
reader loads it (``tests/dist/test_hashed_save.py`` loads it back with megatron's own load).

Trust: a write-time digest is used only when its byte count equals the file's size on disk after the save
(megatron's writer fsyncs each file before it reports); every other file (a writer that bypassed the
stream, a megatron or torch version that writes differently) is read back and hashed as before, so the
worst case is the old speed, never a manifest that misses a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
from multiprocessing.sharedctypes import RawArray
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

_SLOT = 8 + 32  # bytes written so far (little-endian u64), then the SHA-256 of them


class _HashingStream:
    """The file object torch DCP writes an item into: every byte goes to the file and to its SHA-256;
    ``flush`` (torch calls it after each item) publishes ``(bytes, digest)`` to the file's slot."""

    def __init__(self, raw: io.IOBase, state: list, slot: memoryview) -> None:
        self.raw, self.state, self.slot = raw, state, slot  # state: [sha256, bytes so far]

    def write(self, b) -> int:
        n = self.raw.write(b)
        view = memoryview(b).cast("B")
        self.state[0].update(view[:n] if n is not None else view)
        self.state[1] += len(view) if n is None else n
        return n

    def flush(self) -> None:
        self.raw.flush()
        self.slot[:8] = self.state[1].to_bytes(8, "little")
        self.slot[8:] = self.state[0].copy().digest()


class HashingTransforms(_StorageWriterTransforms):
    """megatron's writer transforms (extensions kept) with a SHA-256 per file of ``paths`` underneath."""

    def __init__(self, inner: _StorageWriterTransforms | None, paths: list[str]) -> None:
        super().__init__(getattr(inner, "extensions", None))
        self.index = {os.path.abspath(p): i for i, p in enumerate(paths)}
        self.slots = RawArray(ctypes.c_ubyte, max(1, len(paths)) * _SLOT)  # shared with forked writers
        self.states: dict[int, list] = {}  # per file, in the writer process that writes it

    def transform_save_stream(self, write_item, raw_stream):
        i = self.index.get(os.path.abspath(getattr(raw_stream, "name", "") or ""))
        if i is not None:
            state = self.states.setdefault(i, [hashlib.sha256(), 0])
            slot = memoryview(self.slots).cast("B")[i * _SLOT : (i + 1) * _SLOT]
            raw_stream = _HashingStream(raw_stream, state, slot)
        return super().transform_save_stream(write_item, raw_stream)

    def digests(self) -> dict[str, tuple[int, str]]:
        """``{path: (bytes, sha256 hex)}`` of every file whose writer reported through its slot."""
        raw = bytes(self.slots)
        out = {}
        for path, i in self.index.items():
            size = int.from_bytes(raw[i * _SLOT : i * _SLOT + 8], "little")
            if size:
                out[path] = (size, raw[i * _SLOT + 8 : (i + 1) * _SLOT].hex())
        return out


def parallel_hashing_save(group) -> FullyParallelSaveStrategyWrapper:
    """megatron's save as its training loop sets it up with ``--ckpt-fully-parallel-save`` and
    ``--ckpt-assume-constant-structure``: the writes of shards replicated over ``group`` (the data-parallel
    group) spread over its ranks instead of all on DP rank 0, around :class:`HashingTorchDistSave`
    (``.base_strategy.written(ckpt)`` after it). Keep it for the next saves of the same state dict
    structure (the trainer keeps one per policy and optimizer format): megatron then reuses the save
    distribution and, once two saves planned alike, the save plan, with no planning collectives."""
    return FullyParallelSaveStrategyWrapper(HashingTorchDistSave(), group, do_cache_distribution=True)


class HashingTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron's default torch_dist save strategy (its own defaults), its writer hashing what it writes."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, cached_metadata=True)  # megatron's constant-structure cache
        self.hashing: HashingTransforms | None = None

    def _get_save_and_finalize_callbacks(self, writer, *args, **kwargs):
        paths = [bucket[0] for bucket in (writer.write_buckets or [])]
        self.hashing = HashingTransforms(getattr(writer, "transforms", None), paths)
        writer.transforms = self.hashing
        return super()._get_save_and_finalize_callbacks(writer, *args, **kwargs)

    def written(self, ckpt: Path) -> dict[str, dict]:
        """This rank's data files under ``ckpt`` with ``{"size", "sha256"}`` taken while writing, each only
        when its byte count equals the file's size on disk (the rest are hashed by reading)."""
        if self.hashing is None:
            return {}
        root = os.path.abspath(ckpt)
        out = {}
        for path, (size, sha) in self.hashing.digests().items():
            if os.path.dirname(path) == root and os.path.isfile(path) and os.path.getsize(path) == size:
                out[os.path.basename(path)] = {"size": size, "sha256": sha}
        return out
