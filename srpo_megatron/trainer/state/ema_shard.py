"""The EMA teacher with its fp32 copy sharded over data parallelism (``parallel.teacher_fp32: sharded``).

The full EMA teacher (``trainer/state/teacher.py``) keeps a whole fp32 copy θ′ on every rank: 4 bytes per
parameter of the stage, as much as the policy's fp32 main params before the distributed optimizer
shards them. Here each DP rank keeps only the slice of θ′ that lines up with *its* shard of the
distributed optimizer's main params (megatron-core's ``DistributedOptimizer``: for each grad buffer and
bucket, rank r owns ``[r·S, (r+1)·S)`` of the bucket, and ``_get_model_param_range_map(p)`` gives, per
parameter, its ``"param"`` range inside the flattened parameter and its ``"gbuf_world"`` range inside
the buffer). Per step and rank:

    θ′_r ← (1 − α)·θ′_r + α·θ_r        (fp32, on the rank's main-param shard θ_r)
    teacher[bucket shard r] ← cast(θ′_r); all-gather each bucket over the buffer's DP group

The teacher module's parameters are re-pointed into flat buffers with exactly the policy's DDP buffer
layout (same offsets, same bucket padding), so the all-gather writes the bf16 forward copy in place, as
megatron's distributed optimizer gathers the policy's own params. The update is the same elementwise
arithmetic on the same fp32 numbers as the unsharded teacher, so the teacher is bit-identical to it
(tests/dist/test_offload.py). fp32 runs: θ′ is the module itself; each rank updates its slice of the
module in place and the same all-gather shares it.

Per-rank fp32 bytes: 4 × (this rank's main-param shard) ≈ 4·N/DP instead of 4·N. The planner counts
exactly this (``planner/memory.py``, ``teacher_fp32: sharded``).

Checkpoints: :func:`teacher_fp32_state` describes θ′ (full or sharded) in model space, as megatron
saves the distributed optimizer's state (``fully_sharded_model_space``): each rank writes its flattened
slice of each parameter under ``teacher_fp32.<param key>``, so a checkpoint resumes exactly at any DP
size and with either teacher mode.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.config import ConfigError
from srpo_megatron.trainer.state import teacher as full_teacher

TEACHER_FP32_PREFIX = "teacher_fp32."


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class ShardedEmaTeacher:
    """The teacher module (policy dtype, flat DDP-layout buffers) and this DP rank's fp32 EMA shards."""

    def __init__(
        self, module: torch.nn.Module, kind: str, alpha: float, optimizer: Any, policy: torch.nn.Module
    ) -> None:
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self.module, self.kind, self.alpha = module, kind, alpha
        self._shard_buffer = shard_buffer
        module.requires_grad_(False)
        module.eval()
        twin = dict(zip(policy.parameters(), module.parameters(), strict=True))
        # (teacher flat buffer [numel of the policy's buffer], the policy's megatron buffer, its shard group)
        self.buffers: list[tuple[torch.Tensor, Any, Any]] = []
        # (policy param, this rank's "param" range, main-param shard [n], teacher view [n], flat buffer)
        self._slices: list[tuple[torch.nn.Parameter, Any, torch.Tensor, torch.Tensor]] = []
        # policy param -> its buffer's shard group: dense DP, or expert DP for experts (EP > 1 differs)
        self._group_of: dict[torch.nn.Parameter, Any] = {}
        for opt in _chained(optimizer):
            if not hasattr(opt, "shard_fp32_from_float16_groups"):
                raise ConfigError(
                    "parallel.teacher_fp32=sharded shards the EMA copy like the distributed optimizer's "
                    "main params: set parallel.distributed_optimizer=true (or teacher_fp32=full)"
                )
            flats = []
            for buffer in opt.buffers:
                group = full_teacher.buffer_group(buffer)
                flat = torch.zeros_like(buffer.param_data)  # [buffer numel], padding included
                for p, (start, end, _) in buffer.param_index_map.items():
                    t = twin[p]
                    flat[start:end].copy_(t.detach().view(-1))
                    t.data = flat[start:end].view(t.shape)
                    self._group_of[p] = group
                flats.append(flat)
                self.buffers.append((flat, buffer, group))
            groups = [
                *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
                *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
            ]
            for model_group, main_group in groups:
                for p, main in zip(model_group, main_group, strict=True):
                    ranges = opt._get_model_param_range_map(p)
                    world = ranges["gbuf_world"]
                    flat = flats[opt.model_param_gbuf_map[p][0]]
                    self._slices.append((p, ranges["param"], main, flat[world.start : world.end]))
        self._params = list(twin)
        missing = [tuple(p.shape) for p in twin if p not in self._group_of]
        if missing:
            raise RuntimeError(f"teacher parameters outside megatron's DDP buffers (shapes {missing[:3]})")
        self.master: list[torch.Tensor] | None = None
        self.reset_master()

    @property
    def sharded(self) -> bool:
        return True

    def reset_master(self) -> None:
        """(Re)build this rank's fp32 shards from the module (at start and after a checkpoint load)."""
        # fp32 module: the module's own slice is the EMA copy (no extra memory).
        self.master = [v if v.dtype == torch.float32 else v.float() for _, _, _, v in self._slices]

    def ema_bytes(self) -> int:
        """Bytes of fp32 EMA state this rank holds beyond the module (0 for fp32 modules)."""
        pairs = zip(self.master, self._slices, strict=True)
        return sum(m.numel() * m.element_size() for m, (*_, v) in pairs if m is not v)

    @torch.no_grad()
    def full_masters(self, empty: bool = False) -> list[torch.Tensor]:
        """The fp32 EMA copy of every policy parameter, full shape (collective over each parameter's shard
        group, dense DP or expert DP, unless ``empty``).

        For checkpoints only: this is the one moment a whole fp32 copy exists (one tensor per parameter,
        so that each is saved on its own storage).
        """
        shards = {p: (r, m) for (p, r, _, _), m in zip(self._slices, self.master, strict=True)}
        out = []
        for p in self._params:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if not empty:
                if p in shards:
                    r, m = shards[p]
                    full[r.start : r.end] = m
                # every rank of the group joins, owner or not; disjoint slices and zeros: the sum is exact
                dist.all_reduce(full, group=self._group_of[p])
            out.append(full.view(p.shape))
        return out

    @torch.no_grad()
    def load_full_masters(self, full: list[torch.Tensor]) -> None:
        """Keep this rank's slice of each full fp32 tensor (policy parameter order)."""
        where = {p: i for i, p in enumerate(self._params)}
        for (p, r, _, view), m in zip(self._slices, self.master, strict=True):
            m.copy_(full[where[p]].reshape(-1)[r.start : r.end])
            if m is not view:
                view.copy_(m)
        self.gather()

    @torch.no_grad()
    def update(self, main_params: list[torch.Tensor] | None = None) -> None:
        """θ′_r ← (1−α)θ′_r + αθ_r on this rank's shard, then all-gather the module; no-op unless ``ema``.

        Collective over each buffer's DP group. ``main_params`` is ignored: the shards are read from the
        optimizer directly (no full fp32 copy is ever assembled).
        """
        if self.kind != "ema":
            return
        a = self.alpha
        for m, (_, _, main, view) in zip(self.master, self._slices, strict=True):
            m.mul_(1.0 - a).add_(main.to(m.dtype), alpha=a)
            if m is not view:
                view.copy_(m)  # the cast for the forward, into this rank's bucket shard
        self.gather()

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather every bucket of the teacher's flat buffers over the buffer's shard group (in place)."""
        for flat, buffer, group in self.buffers:
            size = dist.get_world_size(group)
            if size == 1:
                continue
            rank = dist.get_rank(group)
            for bucket in buffer.buckets:
                region = flat[bucket.offset : bucket.offset + bucket.param_data.numel()]
                dist.all_gather_into_tensor(region, self._shard_buffer(region, size)[rank], group=group)


def ema_bytes(teacher: Any) -> int:
    """fp32 EMA bytes a teacher (full or sharded) holds on this rank beyond its module."""
    if teacher is None:
        return 0
    if hasattr(teacher, "ema_bytes"):
        return teacher.ema_bytes()
    return sum(m.numel() * m.element_size() for m in teacher.master or [])


def teacher_fp32_state(teacher: Any, policy: torch.nn.Module, model_sd: dict, loading: bool) -> dict:
    """ShardedTensors of the teacher's fp32 EMA copy in the policy's model space (empty: nothing to save).

    ``model_sd``: the policy's ``sharded_state_dict`` (its ShardedTensors and factories give each
    parameter's key, TP/PP placement and replica id, so only DP replica 0 writes). Each parameter is
    saved whole, as megatron's ``fully_reshardable`` optimizer format does (megatron-core 0.16 dropped
    ``flattened_range``): a sharded teacher all-reduces its disjoint slices into a full fp32 tensor per
    parameter for the save (temporary), and on load every rank reads the whole tensor and keeps its
    slice. The format is the same for both teacher modes and any DP size.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    shares = getattr(teacher, "shares_module", False)  # LoRA: the adapters' EMA is the whole teacher
    if teacher is None or (teacher.kind != "ema" and not shares) or not ema_bytes(teacher):
        return {}  # no teacher, not an EMA, or fp32: the saved teacher module is the fp32 copy
    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    meta = {sh.data: sh for sh in nested_values(tensors)}
    params = list(teacher.params) if shares else list(policy.parameters())
    sharded = isinstance(teacher, ShardedEmaTeacher)
    full = teacher.full_masters(empty=loading) if sharded else teacher.master
    out: dict[str, Any] = {}
    for i, (p, m) in enumerate(zip(params, full, strict=True)):
        sh = meta[p]
        kwargs: dict[str, Any] = dict(key=TEACHER_FP32_PREFIX + sh.key, data=m, dtype=torch.float32)
        if isinstance(sh, ShardedTensorFactory):
            kwargs.pop("dtype")
        out[str(i)] = replace(sh, **kwargs)
    return out


@torch.no_grad()
def load_teacher_fp32(teacher: Any, loaded: dict) -> None:
    """Copy a loaded :func:`teacher_fp32_state` into the teacher's fp32 copy (after ``reset_master``)."""
    if isinstance(teacher, ShardedEmaTeacher):
        teacher.load_full_masters([loaded[str(i)] for i in range(len(loaded))])
        return
    for i, m in enumerate(teacher.master):
        m.copy_(loaded[str(i)].view(m.shape))
