"""Stream a Megatron policy (any TP/PP layout) as HF-named tensors, through the conversion table.

The one place that turns the trainer's sharded parameters into what a rollout engine loads:

- each PP stage exports only its own layers (global layer index = local + the stage's layer offset);
- TP shards of a parameter are *gathered* on the TP group onto TP rank 0 only (not all-gathered) and
  assembled in place: where each shard lies in the full tensor comes from ``split_tp_shard`` (gated
  ``linear_fc1`` halves included), then ``ConversionTable.to_hf`` gives the HF tensors. On gloo the
  shards travel point-to-point (gloo's ``gather`` would stage them all in one more buffer), on NCCL by
  ``dist.gather``;
- exactly one rank per stage sends: TP rank 0 of data-parallel rank 0 and context-parallel rank 0
  (``is_stage_sender``); other DP and CP replicas (CP ranks hold identical weights) do nothing;
- the stream is lazy, one megatron parameter at a time, and announces each parameter's HF tensors
  (``TensorSpec``: name, dtype, shape) before gathering it. ``buckets.flat_buckets`` plans a bucket from
  them, allocates it as one flat buffer and has each parameter written into its slots (``fetch_into``):
  where the HF tensors are the full tensor's consecutive pieces in the slots' dtype (embedding, gate/up,
  row-parallel weights) the shards land straight in the bucket; otherwise (the per-group QKV split, a
  cast, vocab padding) in one temporary full tensor converted into the slots. A sender holds at most
  ``bucket_bytes`` plus one full parameter — never a full model copy. ``fetch()`` (list consumers)
  returns separately allocated tensors.

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

from srpo_megatron.buckets import PendingParam, TensorSpec
from srpo_megatron.conversion.table import ConversionTable, TPPartition, merge_tp_shards, split_tp_shard
from srpo_megatron.conversion.weights import (
    EXPERT_BIAS_SUFFIX,
    policy_named_tensors,
    rank_param_name,
    stage_expert_offset,
    stage_layer_offset,
)
from srpo_megatron.models.lora import merged_shard
from srpo_megatron.parallel import ParallelGroups


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
    for local_name, _ in policy_named_tensors(model):
        if local_name == "output_layer.weight" and table.arch.tie_embeddings:
            continue
        if ".lora." in f".{local_name}":  # LoRA adapters: merged into their base weight, or synced apart
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
    merge_lora: bool = True,
) -> Iterator[PendingParam]:
    """This stage's parameters as ``PendingParam``s, in model order. Every TP rank of the stage must call
    each ``fetch()`` (it joins the TP gather); only the stage sender gets tensors, the others ``[]``.
    ``nbytes`` (the HF bytes ``fetch`` will return) lets a bucketer flush *before* gathering.

    ``dtype``: cast each exported tensor (e.g. fp32 master -> bf16 engine), ``None`` keeps the param's.
    ``all_replicas``: every data-parallel replica exports (onto its own TP rank 0), so each rollout
    engine can be fed by the replica it is colocated with; default: replica 0 only.
    ``merge_lora``: a LoRA policy's adapted weights go as ``W + (alpha/r) B A`` (``models.lora.merged_shard``,
    folded into each rank's shard before the usual gather, so TP/EP need nothing more); False sends the
    frozen base (``lora.sync: adapter`` moves the adapters apart, ``weights.lora_engine_sync``). The adapter
    tensors themselves are never in this stream.
    """
    model = _unwrap(model)
    params = dict(policy_named_tensors(model))
    for local_name, name in stage_param_names(model, table):
        expert = table.partition(name).expert
        # Replicas simply do not take part (unless ``all_replicas``): whole TP groups share a DP rank, whole
        # EP x ETP groups an expert-DP rank. CP ranks hold identical dense weights: only CP rank 0 sends.
        dp_like = groups.edp_rank if expert else groups.dp_rank
        if (not all_replicas and dp_like != 0) or (not expert and groups.cp_rank != 0):
            continue
        param = params[local_name].detach()
        if merge_lora:
            param = _lazy_merged(model, local_name, param)
        # The expert bias travels in fp32 whatever the engine dtype: HF and SGLang keep it in fp32, and a
        # bf16 round trip would move near-tied experts' scores and with them the engine's choices.
        dtype_here = None if name.endswith(EXPERT_BIAS_SUFFIX) else dtype
        specs = _specs(table, groups, name, param, dtype_here, expert, all_replicas)
        nbytes = sum(s.nbytes for s in specs)
        if expert:
            fetch = functools.partial(
                _fetch_expert, table, groups, name, param, dtype_here, all_replicas=all_replicas
            )
            yield PendingParam(name, nbytes, fetch, specs)
            continue
        fetch = functools.partial(_fetch, table, groups, name, param, dtype_here)
        yield PendingParam(name, nbytes, fetch, specs, functools.partial(_fetch_into, fetch))


class _Merged:
    """Stands for a LoRA linear's weight in the stream: shape/dtype of the base shard, and the merged shard
    made only when ``fetch`` runs (one parameter at a time, like the gather itself)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.shape, self.dtype = module, module.weight.shape, module.weight.dtype

    def materialize(self) -> torch.Tensor:
        return merged_shard(self.module)


def _lazy_merged(model: torch.nn.Module, local_name: str, param: torch.Tensor):
    """``param``, or a :class:`_Merged` when it is the weight of a linear carrying LoRA adapters."""
    owner, _, leaf = local_name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf != "weight" or getattr(module, "_lora_plan", None) is None:
        return param
    return _Merged(module)


def _real(param) -> torch.Tensor:
    return param.materialize() if isinstance(param, _Merged) else param


def _specs(
    table: ConversionTable,
    groups: ParallelGroups,
    name: str,
    param: torch.Tensor,
    dtype: torch.dtype | None,
    expert: bool,
    all_replicas: bool,
) -> tuple[TensorSpec, ...]:
    """What ``_fetch`` / ``_fetch_expert`` return on this rank (nothing off the rank that receives)."""
    dtype = dtype or param.dtype
    if not expert:
        names = [name] if groups.tp_rank == 0 else []
    else:
        if all_replicas:
            receives = groups.tp_rank == 0
        else:
            receives = (groups.etp_size == 1 or groups.etp_rank == 0) and (
                groups.ep_size == 1 or groups.ep_rank == 0
            )
        names = _expert_names(table, groups, name) if receives else []
    return tuple(TensorSpec(h, dtype, table.hf_shape(h)) for n in names for h in table.hf_names_for(n))


def _expert_names(table: ConversionTable, groups: ParallelGroups, name: str) -> list[str]:
    """Global names of the expert parameter ``name`` (local index j) on every EP rank, in EP rank order:
    rank r holds global expert ``j + r * E / ep``; ``name`` carries this rank's."""
    per_rank = table.arch.num_experts // groups.ep_size
    prefix, rest = name.split(".local_experts.")
    mine, suffix = rest.split(".", 1)
    first = int(mine) - groups.ep_rank * per_rank
    return [f"{prefix}.local_experts.{first + r * per_rank}.{suffix}" for r in range(groups.ep_size)]


@torch.no_grad()
def _fetch(
    table: ConversionTable,
    groups: ParallelGroups,
    name: str,
    param: torch.Tensor,
    dtype: torch.dtype | None,
    out: list[torch.Tensor] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Gather ``param`` onto TP rank 0 and convert it: its HF tensors there, ``[]`` elsewhere. With
    ``out`` (views of a flat bucket, one per HF tensor, on TP rank 0) the tensors are written into ``out``
    (cast on the way) and nothing is returned. Where the HF tensors are the full tensor's consecutive
    pieces laid out like the bucket's slots (embedding, gate/up, row-parallel weights) the shards are
    received straight into the bucket; otherwise (the per-group QKV split, a cast, vocab padding) into
    one temporary full tensor that is then converted into the slots."""
    param = _real(param)
    part = table.partition(name)
    dst_is_me = groups.tp_rank == 0
    tp = groups.tp_size if part.dim is not None else 1
    full_shape = list(param.shape)
    if tp > 1:
        full_shape[part.dim] *= tp
    if not dst_is_me:
        if tp > 1:
            _send_shard(param, part, groups)
        return []
    if tp == 1:
        full = param
    else:
        in_place = out is not None and _tiles(table, name, full_shape, param.dtype, out)
        full = (
            _region(out, full_shape)
            if in_place
            else torch.empty(full_shape, dtype=param.dtype, device=param.device)
        )
        _receive_shards(full, param, part, groups)
        if in_place:
            return []
    converted = table.to_hf(name, full)
    del full  # fused tensors were split into copies: keep alive only what is returned
    if out is not None:
        for dst, (_, t) in zip(out, converted, strict=True):
            dst.copy_(t)  # casts to the bucket's dtype
        return []
    return [(h, (t if dtype is None else t.to(dtype)).contiguous()) for h, t in converted]


def _fetch_into(fetch: functools.partial, out: list[torch.Tensor]) -> None:
    fetch(out=out)


@functools.lru_cache(maxsize=4096)
def _runs(part: TPPartition, tp: int, rank: int, full_len: int) -> tuple[tuple[int, int, int], ...]:
    """Where TP rank ``rank``'s shard lies in the full tensor along ``part.dim``: ``(full_start,
    shard_start, length)`` runs of consecutive slices, derived from ``split_tp_shard`` itself (one run for
    column/row-parallel, two for gated ``[gate_r; up_r]``). Host-side, from shapes only."""
    shape = [1] * (part.dim + 1)
    shape[part.dim] = full_len
    index = split_tp_shard(torch.arange(full_len).view(shape), part, tp, rank).reshape(-1).tolist()
    runs, start = [], 0
    for k in range(1, len(index) + 1):
        if k == len(index) or index[k] != index[k - 1] + 1:
            runs.append((index[start], start, k - start))
            start = k
    return tuple(runs)


def _point_to_point(groups: ParallelGroups) -> bool:
    """Shards travel point-to-point on gloo, whose ``gather`` stages all shards in one more temporary
    on the root. NCCL's ``gather`` writes each shard straight into its output through the TP group's
    own communicator, where point-to-point would open one more communicator per rank pair."""
    return dist.get_backend(groups.tp) == "gloo"


def _send_shard(param: torch.Tensor, part: TPPartition, groups: ParallelGroups) -> None:
    """TP rank r > 0: send this rank's shard to TP rank 0 (see ``_receive_shards``)."""
    root = dist.get_global_rank(groups.tp, 0)
    if not _point_to_point(groups):
        dist.gather(param.contiguous(), None, dst=root, group=groups.tp)
    elif part.dim != 0:
        dist.send(param.contiguous(), dst=root, group=groups.tp)
    else:  # one message per run along dim 0: each lands in its place on the root
        full_len = param.shape[0] * groups.tp_size
        for _, at, n in _runs(part, groups.tp_size, groups.tp_rank, full_len):
            dist.send(param.narrow(0, at, n).contiguous(), dst=root, group=groups.tp)


def _receive_shards(full: torch.Tensor, param: torch.Tensor, part: TPPartition, groups: ParallelGroups):
    """TP rank 0: assemble ``full`` from every rank's shard, in place. A shard that is one dim-0 run
    (column-parallel) is received straight into its rows; others (gated: two runs; row-parallel: columns)
    go through shard-sized buffers copied into their runs: one at a time point-to-point (gloo), all of
    them for NCCL's ``gather`` (one parameter). Rank 0's own shard is a local copy."""
    d, tp = part.dim, groups.tp_size
    runs = [_runs(part, tp, r, full.shape[d]) for r in range(tp)]
    if not _point_to_point(groups):
        direct = d == 0 and all(len(rr) == 1 for rr in runs)
        outputs = (
            [full.narrow(0, rr[0][0], rr[0][2]) for rr in runs]
            if direct
            else [torch.empty_like(param) for _ in range(tp)]
        )
        dist.gather(param.contiguous(), outputs, dst=dist.get_global_rank(groups.tp, 0), group=groups.tp)
        if not direct:
            for shard, rr in zip(outputs, runs, strict=True):
                for at, src, n in rr:
                    full.narrow(d, at, n).copy_(shard.narrow(d, src, n))
        return
    staging = torch.empty_like(param) if d != 0 else None
    for r in range(tp):
        if r == 0:
            for at, src, n in runs[0]:
                full.narrow(d, at, n).copy_(param.narrow(d, src, n))
            continue
        peer = dist.get_global_rank(groups.tp, r)
        if staging is None:
            for at, _, n in runs[r]:
                dist.recv(full.narrow(0, at, n), src=peer, group=groups.tp)
            continue
        dist.recv(staging, src=peer, group=groups.tp)
        for at, src, n in runs[r]:
            full.narrow(d, at, n).copy_(staging.narrow(d, src, n))


def _region(out: list[torch.Tensor], shape: list[int]) -> torch.Tensor:
    """The bucket memory that starts at slot ``out[0]`` (consecutive slots, see ``_tiles``) as one
    contiguous tensor of ``shape``."""
    strides = torch.empty(shape, device="meta").stride()
    return out[0].as_strided(shape, strides)


def _tiles(
    table: ConversionTable, name: str, full_shape: list[int], dtype: torch.dtype, out: list[torch.Tensor]
) -> bool:
    """Whether the full tensor, placed at ``out[0]``, IS the HF tensors: ``to_hf`` returns contiguous,
    consecutive pieces of it, in order (checked on a meta tensor), of the slots' dtype, and the slots are
    consecutive in the bucket (no alignment gap)."""
    hf = table.to_hf(name, torch.empty(full_shape, dtype=dtype, device="meta"))
    at, ptr = 0, out[0].data_ptr()
    for (_, t), slot in zip(hf, out, strict=True):
        if slot.dtype != dtype or slot.shape != t.shape or not t.is_contiguous():
            return False
        if t.storage_offset() != at or slot.data_ptr() != ptr + at * t.element_size():
            return False
        at += t.numel()
    return at == math.prod(full_shape)


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
    full = param = _real(param)
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
    out = []
    for global_name, tensor in zip(_expert_names(table, groups, name), experts, strict=True):
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
