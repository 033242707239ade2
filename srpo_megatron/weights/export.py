"""Stream a Megatron policy (any TP/PP layout) as HF-named tensors, through the conversion table.

The one place that turns the trainer's sharded parameters into what a rollout engine loads:

- each PP stage exports only its own layers (global layer index = local + the stage's layer offset);
- TP shards of a parameter are *gathered* on the TP group onto TP rank 0 (``dist.gather``, not all-gather:
  only the sender holds the full tensor) and merged with ``merge_tp_shards`` (gated ``linear_fc1`` halves
  handled), then split into HF tensors with ``ConversionTable.to_hf``;
- exactly one rank per stage sends: TP rank 0 of data-parallel rank 0 and context-parallel rank 0
  (``is_stage_sender``); other DP and CP replicas (CP ranks hold identical weights) do nothing;
- the stream is lazy, one megatron parameter at a time, and announces each parameter's HF byte size
  before gathering it, so ``bucketize_pending`` sends the current bucket first when the next parameter
  would overflow it: a sender holds at most ``bucket_bytes`` plus one gathered parameter (column-parallel
  shards are gathered straight into the full tensor; row/gated ones need one merge copy) — never a full
  model copy.

The tied ``output_layer`` of the last stage is skipped: the embedding (first stage) carries it.

MoE experts live elsewhere: each EP rank holds ``E / ep`` whole experts, each split over the ETP group,
replicated over the expert-data-parallel group (not the DP group). An expert parameter (local index ``j``) is
gathered first over ETP onto ETP rank 0 (merged like any TP shard), then over EP onto the stage sender,
which thereby receives global experts ``j, j + E/ep, ...`` (one tensor per EP rank): the sender holds at
most ``bucket_bytes`` plus ``ep`` experts' tensors. The stage sender is the lowest rank of its stage,
hence rank 0 of its ETP, EP and expert-DP groups. Only expert-DP replica 0 takes part in expert gathers
(megatron's expert-DP group already spans the CP ranks), only DP replica 0 of CP rank 0 in the others.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from srpo_megatron.conversion.table import ConversionTable, merge_tp_shards
from srpo_megatron.conversion.weights import rank_param_name, stage_expert_offset, stage_layer_offset
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.weights.buckets import PendingParam


def is_stage_sender(groups: ParallelGroups) -> bool:
    """The one rank of each PP stage that sends that stage's tensors."""
    return groups.tp_rank == 0 and groups.dp_rank == 0 and groups.cp_rank == 0


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # megatron DDP / Float16Module wrappers
        model = model.module
    return model


def stage_param_names(model: torch.nn.Module, table: ConversionTable) -> list[tuple[str, str]]:
    """``(local name, global table name)`` of the parameters this stage exports, in model order."""
    model = _unwrap(model)
    offset, expert_offset = stage_layer_offset(model), stage_expert_offset(table)
    out = []
    for local_name, _ in model.named_parameters():
        if local_name == "output_layer.weight" and table.arch.tie_embeddings:
            continue
        out.append((local_name, rank_param_name(table, local_name, offset, expert_offset)))
    return out


def iter_stage_params(
    model: torch.nn.Module,
    table: ConversionTable,
    groups: ParallelGroups,
    dtype: torch.dtype | None = None,
    *,
    all_replicas: bool = False,
) -> Iterator[PendingParam]:
    """This stage's parameters as ``PendingParam``s, in model order. Every TP rank of the stage must call
    each ``fetch()`` (it joins the TP gather); only the stage sender gets tensors, the others ``[]``.
    ``nbytes`` (the HF bytes ``fetch`` will return) lets a bucketer flush *before* gathering.

    ``dtype``: cast each exported tensor (e.g. fp32 master -> bf16 engine), ``None`` keeps the param's.
    ``all_replicas``: every data-parallel replica exports (onto its own TP rank 0), so each rollout
    engine can be fed by the replica it is colocated with; default: replica 0 only.
    """
    model = _unwrap(model)
    params = dict(model.named_parameters())
    for local_name, name in stage_param_names(model, table):
        expert = table.partition(name).expert
        # Replicas simply do not take part (unless ``all_replicas``): whole TP groups share a DP rank, whole
        # EP x ETP groups an expert-DP rank. CP ranks hold identical dense weights: only CP rank 0 sends.
        dp_like = groups.edp_rank if expert else groups.dp_rank
        if (not all_replicas and dp_like != 0) or (not expert and groups.cp_rank != 0):
            continue
        param = params[local_name].detach()
        nbytes = 0
        if groups.tp_rank == 0 and (all_replicas or groups.dp_rank == 0):
            size = (dtype or param.dtype).itemsize
            nbytes = sum(math.prod(table.hf_shape(h)) * size for h in table.hf_names_for(name))
            nbytes *= groups.ep_size if expert else 1
        fetch = functools.partial(_fetch_expert, all_replicas=all_replicas) if expert else _fetch
        yield PendingParam(name, nbytes, functools.partial(fetch, table, groups, name, param, dtype))


@torch.no_grad()
def _fetch(
    table: ConversionTable, groups: ParallelGroups, name: str, param: torch.Tensor, dtype: torch.dtype | None
) -> list[tuple[str, torch.Tensor]]:
    part = table.partition(name)
    dst_is_me = groups.tp_rank == 0
    if part.dim is not None and groups.tp_size > 1:
        full_shape = list(param.shape)
        full_shape[part.dim] *= groups.tp_size
        full = shards = None
        if dst_is_me and part.dim == 0 and not part.gated:
            # Column-parallel: gather straight into the rows of the full tensor (no merge copy).
            full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
            shards = list(full.chunk(groups.tp_size, dim=0))
        elif dst_is_me:
            shards = [torch.empty_like(param) for _ in range(groups.tp_size)]
        dist.gather(param.contiguous(), shards, dst=dist.get_global_rank(groups.tp, 0), group=groups.tp)
        if not dst_is_me:
            return []
        if full is None:
            full = merge_tp_shards(shards, part)
        del shards
    elif not dst_is_me:
        return []
    else:
        full = param
    converted = table.to_hf(name, full)
    del full  # fused tensors were split into copies: keep alive only what is returned
    return [(h, (t if dtype is None else t.to(dtype)).contiguous()) for h, t in converted]


def _collect(
    tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int, everywhere: bool
) -> list[torch.Tensor] | None:
    """The group's tensors on its rank 0 (``dist.gather``), or on every rank (``everywhere``: all-gather)."""
    if everywhere:
        out = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return out
    out = [torch.empty_like(tensor) for _ in range(size)] if rank == 0 else None
    dist.gather(tensor.contiguous(), out, dst=dist.get_global_rank(group, 0), group=group)
    return out


@torch.no_grad()
def _fetch_expert(
    table: ConversionTable,
    groups: ParallelGroups,
    name: str,
    param: torch.Tensor,
    dtype: torch.dtype | None,
    *,
    all_replicas: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """Gather one local expert parameter over ETP, then that expert index of every EP rank onto the sender.

    ``all_replicas``: the EP group may span several data-parallel replicas (Megatron folds EP into DP), so
    a replica's sender is not always EP rank 0: gather on every rank (all-gather), and every replica's TP
    rank 0 returns all experts. Same per-rank bound (``ep`` experts' tensors), more traffic."""
    part = table.partition(name)
    full = param
    if groups.etp_size > 1:
        shards = _collect(param, groups.etp, groups.etp_rank, groups.etp_size, all_replicas)
        if shards is None:
            return []
        full = merge_tp_shards(shards, part)
        del shards
    experts: list[torch.Tensor] | None = [full]
    if groups.ep_size > 1:
        experts = _collect(full, groups.ep, groups.ep_rank, groups.ep_size, all_replicas)
        if experts is None:
            return []
    del full
    if all_replicas and groups.tp_rank != 0:
        return []
    # This rank's name carries its EP rank's global expert index j + ep_rank*E/ep; rank r has j + r*E/ep.
    per_rank = table.arch.num_experts // groups.ep_size
    mine = int(name.split(".local_experts.")[1].split(".")[0])
    first = mine - groups.ep_rank * per_rank
    prefix, suffix = name.split(".local_experts.")[0], name.split(".local_experts.")[1].split(".", 1)[1]
    out = []
    for r, tensor in enumerate(experts):
        global_name = f"{prefix}.local_experts.{first + r * per_rank}.{suffix}"
        out.extend(
            (h, (t if dtype is None else t.to(dtype)).contiguous())
            for h, t in table.to_hf(global_name, tensor)
        )
    return out


def iter_stage_hf_tensors(
    model: torch.nn.Module, table: ConversionTable, groups: ParallelGroups, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's HF tensors, one parameter at a time (all TP ranks of the stage must iterate)."""
    for pending in iter_stage_params(model, table, groups, dtype):
        yield from pending.fetch()


def hf_manifest(table: ConversionTable) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a full sync sends, with its shape (what a receiver validates against)."""
    return {h: table.hf_shape(h) for h in table.hf_names()}
