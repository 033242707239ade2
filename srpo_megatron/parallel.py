"""Distributed set-up: torch.distributed + megatron-core model parallel state, on GPU (NCCL) or CPU (gloo).

This is the one place that touches global parallel state. Everything downstream receives explicit
process groups (``ParallelGroups``) so the maths can be tested without megatron's globals.

Device discipline: ``ParallelGroups.device`` is the runtime's one device (``cuda:<LOCAL_RANK>`` with
CUDA, else the CPU). megatron's TP/PP/DP groups are NCCL on GPU and carry device tensors only; host
objects (rollout batches, step stats, sync headers, object gathers) travel over ``ParallelGroups.host``,
a gloo group over all ranks. On GPU the default group is ``cpu:gloo,cuda:nccl`` so that megatron's own
host-object collectives (e.g. in ``dist_checkpointing``) keep working.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from srpo_megatron.compat.cpu import cuda_emulated, enable_cpu_compat
from srpo_megatron.compat.fallbacks import announce_fallbacks, hide_fallback_warnings
from srpo_megatron.compat.mcore import warn_if_untested

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class ParallelGroups:
    """Explicit process groups handed to losses, weight sync and checkpointing."""

    tp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    host: dist.ProcessGroup | None = None  # gloo group over all ranks, for host objects (None = default)
    device: torch.device = _CPU  # the runtime's device: model, micro-batches, NCCL tensors
    ep: dist.ProcessGroup | None = None  # expert-parallel group (MoE experts are split over it)
    etp: dist.ProcessGroup | None = None  # expert-tensor-parallel group (each expert's TP shards)
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    edp_rank: int = 0  # rank in the expert-data-parallel group (replicas of the same experts)
    cp: dist.ProcessGroup | None = None  # context-parallel group (the ranks splitting one sequence)
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_distributed(timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed from torchrun's env (or a single process), NCCL on GPU, gloo on CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        enable_cpu_compat()
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # A plain `srpo train` without torchrun: one rank, rendezvous through a file (no port to race for).
        import tempfile

        store = dist.FileStore(tempfile.mktemp(prefix="srpo-store-"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)


def initialize_model_parallel(
    tp: int = 1, pp: int = 1, seed: int = 1234, *, ep: int = 1, etp: int = 1, cp: int = 1
) -> ParallelGroups:
    """Set up megatron's TP/PP/CP/DP and expert EP/ETP groups (torch.distributed must be initialised) and
    seed the RNGs. Attention layers see world = tp * pp * cp * dp, MoE experts world = etp * ep * pp *
    expert-dp."""
    hide_fallback_warnings()  # before this process's first megatron import, if nothing imported it yet
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    init_distributed()
    warn_if_untested()
    announce_fallbacks(print if dist.get_rank() == 0 else lambda _: None)
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
            f"launch a multiple of {tp * pp * cp} ranks"
        )
    if world % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}; launch a multiple of "
            f"{etp * ep * pp} ranks or lower parallel.ep / parallel.etp"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_groups()


def runtime_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is present (or emulated by the strict-device test mode), else CPU."""
    if torch.cuda.is_available() or cuda_emulated():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


_HOST: dict[str, dist.ProcessGroup] = {}


def host_group() -> dist.ProcessGroup:
    """The gloo group over all ranks (collective on first use after ``init_process_group``)."""
    key = str(id(dist.distributed_c10d._get_default_group()))
    if key not in _HOST:
        _HOST.clear()
        _HOST[key] = dist.new_group(backend="gloo")
    return _HOST[key]


def is_host_group(group: dist.ProcessGroup | None) -> bool:
    return group is not None and any(group is g for g in _HOST.values())


def current_groups() -> ParallelGroups:
    from megatron.core import parallel_state as ps

    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        host=host_group(),
        device=runtime_device(),
        ep=ps.get_expert_model_parallel_group(),
        etp=ps.get_expert_tensor_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        cp=ps.get_context_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
