"""Write a megatron-core ``torch_dist`` checkpoint one tensor at a time (single process, no model copy).

``megatron.core.dist_checkpointing.save`` needs every tensor of the state dict in memory at once and
plans/writes through torch DCP's collective machinery, which is slow on CPU. This writer produces the same
directory from a *preprocessed* sharded state dict (``save_preprocess`` output: ``ShardedTensor`` and
``ShardedObject`` leaves), but pulls each tensor's data on demand and writes it immediately:

    __0_0.distcp    every item serialised as torch DCP's ``TORCH_SAVE`` format does it (one
                    ``torch.save`` per tensor chunk; ``ShardedObject`` s as ``torch.save([data])``,
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
    data_of: Callable[[list[ShardedTensor]], list[torch.Tensor]],
    groups: list[list[ShardedTensor]] | None = None,
) -> None:
    """Write the checkpoint of ``sharded_part`` (``save_preprocess`` output) into ``out_dir``.

    ``data_of(group)`` returns the data of each ShardedTensor of ``group`` (shape ``local_shape``,
    the dtype written in the metadata); it is called once per group, in order, and the tensors are
    dropped after writing, so peak memory is one group's data.
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
    # the write itself (~100 MB/s measured): switch them off for this write only.
    crc32 = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        with open(out / DATA_FILE, "wb") as f:

            def put(index: MetadataIndex, item: torch.Tensor | list) -> None:
                start = f.tell()
                torch.save(item, f)
                storage[index] = _StorageInfo(DATA_FILE, start, f.tell() - start)

            for obj in objects:
                state_md[obj.unique_key] = BytesStorageMetadata()
                put(MetadataIndex(obj.unique_key), [obj.data])

            def write_group(group: list[ShardedTensor], chunks: list[torch.Tensor]) -> None:
                for sh, chunk in zip(group, chunks, strict=True):
                    md = state_md.setdefault(
                        sh.key,
                        TensorStorageMetadata(TensorProperties(chunk.dtype), torch.Size(sh.global_shape), []),
                    )
                    if md.properties.dtype != chunk.dtype:
                        raise ValueError(f"{sh.key}: chunks disagree on dtype")
                    md.chunks.append(ChunkStorageMetadata(torch.Size(sh.global_offset), chunk.shape))
                    put(MetadataIndex(sh.key, torch.Size(sh.global_offset)), chunk)

            for group in groups:
                write_group(group, [_chunk(sh, d) for sh, d in zip(group, data_of(group), strict=True)])
    finally:
        torch.serialization.set_crc32_options(crc32)
    metadata = Metadata(state_md, None, storage, StorageMeta(), CURRENT_DCP_VERSION)
    # Same serialisation as torch.distributed.checkpoint.FileSystemWriter.finish.
    with open(out / DCP_METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    if common_pt:
        from megatron.core.dist_checkpointing.serialization import get_default_save_common_strategy

        get_default_save_common_strategy().save_common(common_state, out)
    save_config(CheckpointingConfig("torch_dist"), str(out))


def _chunk(sh: ShardedTensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` as the DCP chunk of ``sh``: ``[1]*prepend_axis_num + local_shape``, owning its storage."""
    if tuple(data.shape) != tuple(sh.local_shape):
        raise ValueError(f"{sh.key}: data {tuple(data.shape)} != local shape {tuple(sh.local_shape)}")
    data = data.detach().contiguous()
    if data.untyped_storage().nbytes() != data.nbytes:
        # torch.save writes a view's whole storage: give the chunk a storage of exactly its bytes, a
        # slice of the same memory (it keeps the parent storage alive), rather than a copy.
        start = data.storage_offset() * data.element_size()
        storage = data.untyped_storage()[start : start + data.nbytes]
        data = torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape)
    return data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))


__all__ = ["write_streamed_checkpoint"]
