"""Stream a Megatron policy (any TP/PP layout) as HF-named tensors, through the conversion table.

The one place that turns the trainer's sharded parameters into what a rollout engine loads:

- each PP stage exports only its own layers (global layer index = local + the stage's layer offset);
- TP shards of a parameter are *gathered* on the TP group onto TP rank 0 (``dist.gather``, not all-gather:
  only the sender holds the full tensor) and merged with ``merge_tp_shards`` (gated ``linear_fc1`` halves
  handled), then split into HF tensors with ``ConversionTable.to_hf``;
- exactly one rank per stage sends: TP rank 0 of data-parallel rank 0 (``is_stage_sender``); other DP
  replicas do nothing;
- the stream is lazy, one megatron parameter at a time, so a rank never holds more than one full
  parameter plus whatever bucket the transport is filling — never a full model copy.

The tied ``output_layer`` of the last stage is skipped: the embedding (first stage) carries it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from srpo_megatron.conversion.table import ConversionTable, merge_tp_shards
from srpo_megatron.conversion.weights import rank_param_name, stage_layer_offset
from srpo_megatron.parallel import ParallelGroups


def is_stage_sender(groups: ParallelGroups) -> bool:
    """The one rank of each PP stage that sends that stage's tensors."""
    return groups.tp_rank == 0 and groups.dp_rank == 0


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # megatron DDP / Float16Module wrappers
        model = model.module
    return model


def stage_param_names(model: torch.nn.Module, table: ConversionTable) -> list[tuple[str, str]]:
    """``(local name, global table name)`` of the parameters this stage exports, in model order."""
    model = _unwrap(model)
    offset = stage_layer_offset(model)
    out = []
    for local_name, _ in model.named_parameters():
        if local_name == "output_layer.weight" and table.arch.tie_embeddings:
            continue
        out.append((local_name, rank_param_name(table, local_name, offset)))
    return out


@torch.no_grad()
def iter_stage_hf_tensors(
    model: torch.nn.Module, table: ConversionTable, groups: ParallelGroups, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's HF tensors, lazily. Every TP rank of the stage must iterate (they join the gathers);
    only the stage sender receives tensors, the others get an empty stream.

    ``dtype``: cast each exported tensor (e.g. fp32 master -> bf16 engine), ``None`` keeps the param's.
    """
    model = _unwrap(model)
    params = dict(model.named_parameters())
    dst_is_me = groups.tp_rank == 0
    for local_name, name in stage_param_names(model, table):
        if groups.dp_rank != 0:
            continue
        param = params[local_name].detach()
        part = table.partition(name)
        if part.dim is not None and groups.tp_size > 1:
            shards = [torch.empty_like(param) for _ in range(groups.tp_size)] if dst_is_me else None
            dst = dist.get_global_rank(groups.tp, 0)
            dist.gather(param.contiguous(), shards, dst=dst, group=groups.tp)
            if not dst_is_me:
                continue
            full = merge_tp_shards(shards, part)
        elif not dst_is_me:
            continue
        else:
            full = param
        for hf_name, t in table.to_hf(name, full):
            yield hf_name, (t if dtype is None else t.to(dtype)).contiguous()


def hf_manifest(table: ConversionTable) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a full sync sends, with its shape (what a receiver validates against)."""
    return {h: table.hf_shape(h) for h in table.hf_names()}
