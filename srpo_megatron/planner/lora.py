"""What ``lora.rank > 0`` changes in an SRPO run's memory, per GPU of the worst pipeline stage.

With LoRA the base weights are frozen: they keep their bf16 copy and get no gradient buffer and no optimizer
state; the adapters train (fp32 gradients, the optimizer's fp32 main copy and two Adam moments, sharded over
DP by the distributed optimizer). The EMA self-teacher keeps an fp32 EMA of the adapters alone; its forward
is the student's base with the EMA adapters swapped in, so no second copy of the model.

Adapter shards follow their base linear (``conversion/lora_table.py`` names them): on a column-parallel
linear (QKV, fc1, MLA's up projections) B is split over TP and A replicated; on a row-parallel one (output
projection, fc2) A is split and B replicated. Expert adapters split over EP (whole experts) and ETP like
their expert. The stage's layers are the trainer's split (``models.architecture.pipeline_stage_layers``).
"""

from __future__ import annotations

import dataclasses
import re

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_table import LoraTable
from srpo_megatron.models.architecture import Architecture, pipeline_stage_layers

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
ADAM_BYTES = 12  # fp32 main copy + two fp32 moments per trained value
GRAD_BYTES = 4  # fp32 gradient (grad_reduce_in_fp32)
EMA_BYTES = 4  # the teacher's fp32 EMA of each adapter value


@dataclasses.dataclass(frozen=True)
class LoraPlan:
    """Adapter parameters and the bytes they cost on one GPU of the worst stage (and model-wide)."""

    adapter_params: int  # the whole model's adapter values (every factor, full shapes)
    adapter_params_per_gpu: int  # on one GPU of the worst stage (TP/EP shards)
    grad_bytes: int  # per GPU: fp32 adapter gradients
    optimizer_bytes: int  # per GPU: fp32 main + Adam moments, /DP with the distributed optimizer
    teacher_bytes: int  # per GPU: the fp32 EMA adapters (the EMA teacher), 0 without one
    teacher_full_bytes: int  # per GPU: what a full-model teacher would hold (bf16 copy + fp32 EMA copy)

    @property
    def teacher_saving(self) -> int:
        return self.teacher_full_bytes - self.teacher_bytes


def _per_rank(table: LoraTable, name: str, tp: int, ep: int, etp: int) -> int:
    """Values of adapter factor ``name`` on one rank (TP/ETP split of the factor its base linear splits)."""
    row = table.row(name)
    base = table.base.partition(name.split(".lora.")[0] + ".weight")
    split = etp if base.expert else tp
    numel = row.shape[0] * row.shape[1]
    column = base.dim == 0
    if (column and row.factor == "lora_B") or (base.dim == 1 and row.factor == "lora_A"):
        numel //= split
    return numel // ep if base.expert else numel


def lora_plan(
    arch: Architecture,
    lora: LoraConfig,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    dp: int = 1,
    distributed_optimizer: bool = True,
    ema_teacher: bool = True,
    stage_params: int = 0,
) -> LoraPlan:
    """The LoRA figures of the worst pipeline stage (most adapter values); ``stage_params``: the base
    parameters one GPU of that stage holds (for the full-model teacher it replaces). Expert values are
    spread over EP as whole experts (E/EP per rank), so ``ep`` divides their count."""
    table = LoraTable(arch, lora)
    n = max(stage_adapter_values(arch, lora, tp, pp, ep, etp, table))
    shard = dp if distributed_optimizer else 1
    return LoraPlan(
        adapter_params=table.numel(),
        adapter_params_per_gpu=n,
        grad_bytes=GRAD_BYTES * n,
        optimizer_bytes=ADAM_BYTES * n // shard,
        teacher_bytes=EMA_BYTES * n if ema_teacher else 0,
        teacher_full_bytes=(2 + 4) * stage_params if ema_teacher else 0,
    )


def stage_adapter_values(
    arch: Architecture, lora: LoraConfig, tp: int, pp: int, ep: int = 1, etp: int = 1, table=None
) -> list[int]:
    """Adapter values one GPU of each pipeline stage holds (its TP/ETP shards, E/EP experts)."""
    table = LoraTable(arch, lora) if table is None else table
    stages = pipeline_stage_layers(arch.num_layers, pp)
    first = [sum(stages[:s]) for s in range(pp)]
    per_stage = [0] * pp
    for name in table.megatron_names():
        layer = int(_LAYER.match(name).group(1))
        stage = max(s for s in range(pp) if first[s] <= layer)
        per_stage[stage] += _per_rank(table, name, tp, ep, etp)
    return per_stage


__all__ = ["ADAM_BYTES", "EMA_BYTES", "GRAD_BYTES", "LoraPlan", "lora_plan", "stage_adapter_values"]
