"""Write a megatron-core ``torch_dist`` checkpoint one tensor at a time (single process, no model copy).

``megatron.core.dist_checkpointing.save`` needs every tensor of the state dict in memory at once and
plans/writes through torch DCP's collective machinery, which is slow on CPU. This writer produces the same
directory from a *preprocessed* sharded state dict (``save_preprocess`` output: ``ShardedTensor`` and
``ShardedObject`` leaves), but pulls each tensor's data on demand and writes it immediately:

    __0_0.distcp    every item serialised as torch DCP's ``TORCH_SAVE`` format does it (the bytes of
                    one ``torch.save`` per tensor chunk, spliced from a cached envelope and the chunk's
                    pieces, see ``torch_save_format``; ``ShardedObject`` s as ``torch.save([data])``,
                    exactly megatron's ``_mcore_to_torch_sharded_object``)
    .metadata       a torch DCP ``Metadata`` (pickled like ``FileSystemWriter.finish``): per key the
                    global shape, dtype and chunks (``(1,) * prepend_axis_num + local_shape`` at
                    ``global_offset``, as megatron's ``sharded_tensor_to_torch_sharded_tensor``), and
                    per chunk the file/offset/length
    common state    the common (non-sharded) state where the installed megatron-core's ``save`` puts
                    it: ``common.pt`` through its common save strategy (<= 0.16), or one more
                    ``ShardedObject`` ``common_state`` in ``__0_0.distcp`` (0.19; see
                    ``compat.mcore.save_writes_common_pt``)
    metadata.json   megatron's ``CheckpointingConfig('torch_dist')``, through ``save_config``

Only main replicas are written (what megatron keeps). Flattened (``flattened_range``) tensors, which a
TP1 model state dict never has, are refused.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from srpo_megatron.compat.mcore import save_writes_common_pt
from srpo_megatron.conversion.torch_save_format import TorchSaveEnvelopes, crc32_off, tensor_bytes
from srpo_megatron.conversion.write_behind import DirectFile

DATA_FILE = "__0_0.distcp"
DCP_METADATA_FILE = ".metadata"


def _main_replicas(sharded_part: dict) -> tuple[list[ShardedTensor], list[ShardedObject]]:
    tensors, objects = [], []
    for item in nested_values(sharded_part):
        if not is_main_replica(item.replica_id):
            continue
        if isinstance(item, ShardedTensor):
            if item.flattened_range is not None:
                raise NotImplementedError(f"{item.key}: flattened ShardedTensors are not streamed")
            tensors.append(item)
        elif isinstance(item, ShardedObject):
            objects.append(item)
        else:
            raise TypeError(f"unexpected sharded state dict leaf {type(item).__name__}")
    return tensors, objects


def write_streamed_checkpoint(
    out_dir: str | Path,
    sharded_part: dict,
    common_state: dict,
    data_of: Callable[[list[ShardedTensor]], list[torch.Tensor | list[torch.Tensor]]],
    groups: list[list[ShardedTensor]] | None = None,
) -> str | None:
    """Write the checkpoint of ``sharded_part`` (``save_preprocess`` output) into ``out_dir``; return
    None, or why the data file could not be written with ``O_DIRECT`` (``write_behind``).

    ``data_of(group)`` returns the data of each ShardedTensor of ``group``: a tensor of shape
    ``local_shape``, or a list of tensors whose row-major elements, concatenated, are that chunk's
    (written one after the other, never concatenated in memory), in the dtype written in the metadata.
    It is called once per group, in order, and the tensors are dropped after writing, so peak memory is
    one group's data.
    ``groups`` (default: one group per ShardedTensor) lets a caller produce tensors that share a source
    together; every main-replica ShardedTensor must be in exactly one group.
    """
    out = Path(out_dir)
    tensors, objects = _main_replicas(sharded_part)
    common_pt = save_writes_common_pt()
    if not common_pt:
        # What megatron-core 0.19's save() does with the common state (replica 0 is the main one).
        objects.append(ShardedObject("common_state", common_state, (1,), (0,), replica_id=0))
    groups = [[t] for t in tensors] if groups is None else groups
    if sorted(id(t) for g in groups for t in g) != sorted(id(t) for t in tensors):
        raise ValueError("groups must hold every main-replica ShardedTensor exactly once")
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    # torch DCP's reader (torch.load) does not check the zip CRC32s, and computing them costs more than
    # the write itself (~100 MB/s measured): switch them off for this write only. With them off, a
    # tensor's torch.save bytes are a (dtype, shape) envelope around its raw bytes (torch_save_format).
    with crc32_off(), _DataFile(out / DATA_FILE) as data_file:
        for obj in objects:
            state_md[obj.unique_key] = BytesStorageMetadata()
            storage[MetadataIndex(obj.unique_key)] = data_file.put_object(obj.data)

        for group in groups:
            _put_group(data_file, group, data_of(group), state_md, storage)
    why_buffered = data_file.why_buffered  # known once the file is closed (its last write)
    metadata = Metadata(state_md, None, storage, StorageMeta(), CURRENT_DCP_VERSION)
    # Same serialisation as torch.distributed.checkpoint.FileSystemWriter.finish.
    with open(out / DCP_METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    if common_pt:
        from megatron.core.dist_checkpointing.serialization import get_default_save_common_strategy

        get_default_save_common_strategy().save_common(common_state, out)
    save_config(CheckpointingConfig("torch_dist"), str(out))
    return why_buffered


def _put_group(
    f: _DataFile,
    group: list[ShardedTensor],
    datas: list[torch.Tensor | list[torch.Tensor]],
    state_md: dict,
    storage: dict,
) -> None:
    """Write one group's chunks and record them in the DCP metadata. A function of its own so that the
    group's data (e.g. the mmapped output layer, the last group) is released when it returns, not kept by
    a loop variable through the metadata pickling that follows the last group."""
    for sh, data in zip(group, datas, strict=True):
        pieces, dtype = _pieces(sh, data)
        size = torch.Size(sh.global_shape)
        md = state_md.setdefault(sh.key, TensorStorageMetadata(TensorProperties(dtype), size, []))
        if md.properties.dtype != dtype:
            raise ValueError(f"{sh.key}: chunks disagree on dtype")
        shape = torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        md.chunks.append(ChunkStorageMetadata(torch.Size(sh.global_offset), shape))
        index = MetadataIndex(sh.key, torch.Size(sh.global_offset))
        storage[index] = f.put_tensor(dtype, shape, pieces)


def _pieces(
    sh: ShardedTensor, data: torch.Tensor | list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.dtype]:
    """Contiguous pieces whose row-major bytes are the chunk of ``sh`` (``local_shape``), and their dtype.
    ``data``: that chunk as one tensor, or already as pieces (``ConversionTable.to_megatron_pieces``)."""
    if isinstance(data, torch.Tensor):
        if tuple(data.shape) != tuple(sh.local_shape):
            raise ValueError(f"{sh.key}: data {tuple(data.shape)} != local shape {tuple(sh.local_shape)}")
        data = [data]
    pieces = [p.detach().contiguous() for p in data]
    dtypes = {p.dtype for p in pieces}
    if len(dtypes) != 1:
        raise ValueError(f"{sh.key}: pieces have dtypes {sorted(map(str, dtypes))}")
    numel = sum(p.numel() for p in pieces)
    if numel != math.prod(sh.local_shape):
        raise ValueError(f"{sh.key}: pieces hold {numel} elements, local shape {tuple(sh.local_shape)}")
    return pieces, pieces[0].dtype


class _DataFile:
    """The ``__0_0.distcp`` file: items appended as ``torch.save`` writes them.

    A tensor item is its cached torch.save envelope around its pieces' bytes (``torch_save_format``), so
    no full chunk is built; items torch.save would not write that way (see ``envelope``) and
    ShardedObjects go through ``torch.save`` itself. The bytes go into a :class:`DirectFile`
    (``write_behind``): copied into its staging buffers (the thousands of small items of an MoE
    checkpoint become a few large writes) and written with ``O_DIRECT`` by its writer thread.
    """

    _BUFFER = 4 << 20  # each of DirectFile's two staging buffers

    def __init__(self, path: Path):
        self.path = path
        self._envelopes = TorchSaveEnvelopes()
        self._objects: dict[str, bytes] = {}

    def __enter__(self) -> _DataFile:
        self._file = DirectFile(self.path, self._BUFFER)  # closed in __exit__
        self._pos = 0  # offset of the next item
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._file.__exit__(exc_type, *exc)

    @property
    def why_buffered(self) -> str | None:
        """Why the file was not written with O_DIRECT (``write_behind``), or None."""
        return self._file.why_buffered

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._file.write(view)  # copied: the caller's tensor can go as soon as this returns
        self._pos += view.nbytes

    def put_tensor(self, dtype: torch.dtype, shape: torch.Size, pieces: list[torch.Tensor]) -> _StorageInfo:
        start = self._pos
        env = self._envelopes.get(dtype, tuple(shape))
        if env is None:
            chunk = pieces[0] if len(pieces) == 1 else torch.cat([p.reshape(-1) for p in pieces])
            buf = io.BytesIO()
            torch.save(_owning(chunk.reshape(shape)), buf)
            self._write(buf.getbuffer())
        else:
            self._write(env[0])
            for p in pieces:
                if p.numel():
                    self._write(tensor_bytes(p))
            self._write(env[1])
        return _StorageInfo(DATA_FILE, start, self._pos - start)

    def put_object(self, data: object) -> _StorageInfo:
        """``torch.save([data])``, exactly megatron's ``_mcore_to_torch_sharded_object``; the bytes of
        ``None`` (every TE ``_extra_state`` of a converted model: one per expert in MoE) are cached."""
        start = self._pos
        if data is None and "None" in self._objects:
            self._write(self._objects["None"])
        else:
            buf = io.BytesIO()
            torch.save([data], buf)
            if data is None:
                self._objects["None"] = buf.getvalue()
            self._write(buf.getbuffer())
        return _StorageInfo(DATA_FILE, start, self._pos - start)


def _owning(data: torch.Tensor) -> torch.Tensor:
    """``data`` with a storage of exactly its bytes (torch.save writes a view's whole storage): a slice of
    the same memory (it keeps the parent storage alive), not a copy."""
    data = data.contiguous()
    if data.untyped_storage().nbytes() != data.nbytes:
        start = data.storage_offset() * data.element_size()
        storage = data.untyped_storage()[start : start + data.nbytes]
        data = torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape)
    return data


__all__ = ["write_streamed_checkpoint"]
