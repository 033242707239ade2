"""A LoRA policy's adapters as a weight stream (``lora.sync: adapter``): PEFT-named, full (TP1) shapes.

The counterpart of ``weights.export.iter_stage_params`` for the adapters alone, so the same feed
(``weights.engine_sync.sync_engines``: buckets, point-to-point between PP stages, one engine per replica)
carries them. Each adapter factor is gathered onto TP rank 0 along its own TP axis (``lora_tp_axis``:
column-parallel B on its rows, row-parallel A on its columns; the replicated factor is taken from TP
rank 0 as is) with the base weights' gather (``export._send_shard`` / ``_receive_shards``), renamed
through ``conversion.lora_table.LoraTable.to_peft``. Expert adapters run locally (ETP 1); under EP > 1 they
would need the experts' EP gather and are refused in one line.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from srpo_megatron.buckets import PendingParam, TensorSpec
from srpo_megatron.conversion.lora_table import LoraTable, lora_canonical_name
from srpo_megatron.conversion.table import REPLICATED, TPPartition
from srpo_megatron.conversion.weights import stage_expert_offset, stage_layer_offset
from srpo_megatron.models.lora import lora_parameters
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.weights.export import _receive_shards, _send_shard, _unwrap
from srpo_megatron.weights.p2p import WeightSyncError


def iter_stage_adapters(
    model: torch.nn.Module,
    lora: LoraTable,
    groups: ParallelGroups,
    dtype: torch.dtype | None = None,
    *,
    all_replicas: bool = False,
) -> Iterator[PendingParam]:
    """This stage's adapter factors as ``PendingParam``s named by PEFT; every TP rank calls each
    ``fetch()`` (the TP gather), only TP rank 0 gets tensors. Replicas as in ``iter_stage_params``."""
    model = _unwrap(model)
    offset, expert_offset = stage_layer_offset(model), stage_expert_offset(lora.base)
    for local_name, param in lora_parameters(model).items():
        row = lora.row(lora_canonical_name(local_name, offset, expert_offset))
        if row.expert and groups.ep_size > 1:
            raise WeightSyncError(
                f"lora.sync=adapter with expert adapters ({row.megatron}) at parallel.ep={groups.ep_size} "
                "is not wired (the expert adapters would need the EP gather); set lora.sync: merged"
            )
        if (not all_replicas and groups.dp_rank != 0) or groups.cp_rank != 0:
            continue
        axis = None if row.expert else getattr(param, "lora_tp_axis", None)
        part = REPLICATED if axis is None else TPPartition(axis)
        out_dtype = dtype or param.dtype
        specs = (TensorSpec(row.peft, out_dtype, row.shape),) if groups.tp_rank == 0 else ()
        nbytes = sum(s.nbytes for s in specs)
        fetch = functools.partial(_fetch_adapter, lora, groups, row.megatron, param.detach(), part, dtype)
        yield PendingParam(row.megatron, nbytes, fetch, specs)


@torch.no_grad()
def _fetch_adapter(
    lora: LoraTable,
    groups: ParallelGroups,
    name: str,
    param: torch.Tensor,
    part: TPPartition,
    dtype: torch.dtype | None,
) -> list[tuple[str, torch.Tensor]]:
    """Gather one adapter factor onto TP rank 0 (its PEFT name and full tensor there, ``[]`` elsewhere)."""
    tp = groups.tp_size if part.dim is not None else 1
    if groups.tp_rank != 0:
        if tp > 1:
            _send_shard(param, part, groups)
        return []
    full = param
    if tp > 1:
        shape = list(param.shape)
        shape[part.dim] *= tp
        full = torch.empty(shape, dtype=param.dtype, device=param.device)
        _receive_shards(full, param, part, groups)
    peft, tensor = lora.to_peft(name, full)
    return [(peft, (tensor if dtype is None else tensor.to(dtype)).contiguous())]
