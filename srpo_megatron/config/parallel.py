"""The recipe's ``parallel`` section: how the policy is split across ranks (the runtime is parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ParallelConfig:
    """How the policy is split across ranks. world_size = tp * pp * cp * dp = etp * ep * pp * expert-dp."""

    tp: int = 1  # tensor-parallel size (Megatron TP; shards attention heads, MLP and the vocabulary)
    pp: int = 1  # pipeline-parallel size (layers split into pp stages)
    cp: int = 1  # context-parallel size (each packed sequence split over cp ranks; needs packing)
    # How TE's attention exchanges K/V under cp > 1 (megatron's cp_comm_type); gpt-oss sinks need a2a
    cp_comm_type: Literal["p2p", "a2a", "all_gather", "a2a+p2p"] = "p2p"
    ep: int = 1  # expert-parallel size (MoE: each EP rank holds num_experts / ep whole experts)
    etp: int = 1  # expert-tensor-parallel size (MoE: TP inside each expert; 1 = experts unsharded)
    distributed_optimizer: bool = False  # shard optimizer state across data-parallel ranks (ZeRO-1)
    sequence_parallel: bool | None = None  # Megatron sequence parallelism; None = on when tp > 1 on CUDA
    # The EMA teacher's fp32 copy: full on every rank, or sharded over DP like the distributed
    # optimizer's main params (needs distributed_optimizer; the bf16 forward copy is all-gathered)
    teacher_fp32: Literal["full", "sharded"] = "full"
    teacher_offload: bool = False  # keep the bf16 teacher in host memory except for its forward and update
    # colocated engine: grads, optimizer state and teacher leave the accelerator during rollouts
    offload_during_rollout: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"parallel.{name}={value} must be >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1; set it to false")
        if self.teacher_fp32 == "sharded" and not self.distributed_optimizer:
            raise ValueError(
                "parallel.teacher_fp32=sharded shards the EMA copy like the distributed optimizer's main "
                "params: set parallel.distributed_optimizer=true, or teacher_fp32=full"
            )
