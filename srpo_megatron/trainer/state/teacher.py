"""The self-teacher (method §1.4): EMA of the student, frozen, or the trust-region mix, with an fp32 copy.

Fidelity fix: the EMA is kept in fp32. The teacher module runs the forward in the policy's dtype, but its
weights are a cast of an fp32 copy θ′ that is updated from the optimizer's fp32 *main* parameters θ:

    θ′ ← (1 − α)·θ′ + α·θ        (fp32, then θ′ is cast into the bf16 module for the forward)

Updating a bf16 teacher in place rounds α·(θ − θ′) away until the gap is ~10 ulp, so the teacher nearly
freezes (tests/unit/test_ema_teacher.py plants that update and shows it misses the float64 EMA); the
SDPO reference keeps its teacher in fp32 as well. In fp32 runs the module's own parameters are the copy.

Main parameters come from megatron's optimizer: with bf16 params the mixed-precision optimizer holds
fp32 copies (``fp32_from_float16_groups``); the distributed optimizer holds only this rank's shard of
each (``shard_fp32_from_float16_groups``; of fp32 params, ``shard_fp32_groups``), cut over the group of
the param's grad buffer: dense DP for dense params, *expert* DP for experts. ``fp32_main_params``
all-reduces each group's disjoint shards into a full fp32 copy per rank (``parallel.teacher_fp32:
full``; ``sharded`` keeps only this rank's shard: trainer/state/ema_shard.py). Reducing the experts over the
dense DP group instead sums different experts' weights at EP > 1 (tests/dist/test_moe_ema_teacher.py).
Checkpoints save the fp32 copy (trainer/state/ema_shard.py), so a resume restores it exactly; checkpoints
written before that restart it from the saved teacher module (one rounding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class EmaTeacher:
    """Owns the teacher module (policy dtype, no grad, eval) and its fp32 copy."""

    def __init__(self, module: torch.nn.Module, kind: str, alpha: float) -> None:
        self.module, self.kind, self.alpha = module, kind, alpha
        module.requires_grad_(False)
        module.eval()
        self.master: list[torch.Tensor] | None = None
        self.reset_master()

    def reset_master(self) -> None:
        """(Re)build the fp32 copy from the module (at start and after a checkpoint load)."""
        params = list(self.module.parameters())
        if all(p.dtype == torch.float32 for p in params):
            self.master = None  # the module itself is the fp32 copy
        else:
            self.master = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self, main_params: list[torch.Tensor]) -> None:
        """θ′ ← (1−α)θ′ + αθ from the student's fp32 main params (module order); no-op unless ``ema``."""
        if self.kind != "ema":
            return
        a = self.alpha
        params = list(self.module.parameters())
        masters = params if self.master is None else self.master
        for m, theta in zip(masters, main_params, strict=True):
            m.mul_(1.0 - a).add_(theta.to(m.dtype), alpha=a)
        if self.master is not None:
            for p, m in zip(params, self.master, strict=True):
                p.copy_(m)  # the cast for the forward


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def buffer_group(buffer) -> dist.ProcessGroup:
    """The group a megatron grad buffer is sharded over by the distributed optimizer.

    ``DistributedOptimizer._build_model_gbuf_range`` cuts each bucket over *its buffer's* data-parallel
    group: dense DP(×CP) for dense parameters, expert DP for experts (``get_megatron_optimizer`` builds
    the expert half of the chained optimizer over ``intra_expt_dp_group``). At EP > 1 the two differ.
    """
    return buffer.data_parallel_group


def shard_layout(optimizer) -> tuple[dict, list[tuple[torch.nn.Parameter, torch.Tensor, range]]]:
    """Where the distributed optimizer keeps the fp32 main params: ``(group_of, shards)``.

    ``group_of[p]``: the group whose ranks together hold ``p``'s main copy (every parameter of every
    DistributedOptimizer buffer, owned here or not); ``shards``: this rank's ``(p, main shard [n], range
    in p.view(-1))``, for bf16 params (their fp32 copies) and fp32 params (views of the param itself).
    Both empty without a DistributedOptimizer.
    """
    group_of: dict = {}
    shards = []
    for opt in _chained(optimizer):
        if not hasattr(opt, "shard_fp32_from_float16_groups"):
            continue
        for buffer in opt.buffers:
            for p in buffer.param_index_map:
                group_of[p] = buffer_group(buffer)
        pairs = [
            *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
            *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
        ]
        for model_group, main_group in pairs:
            for p, shard in zip(model_group, main_group, strict=True):
                rng = opt._get_model_param_range_map(p)["param"]
                shards.append((p, shard, range(rng.start, rng.end)))
    return group_of, shards


@torch.no_grad()
def fp32_main_params(
    optimizer, model: torch.nn.Module, device: torch.device, params: list | None = None
) -> list[torch.Tensor]:
    """The optimizer's fp32 main copy of every parameter of ``model`` (module order, full shape), or of
    ``params`` only (a LoRA teacher's adapters: trainer/state/adapter_teacher.py).

    Collective over each group the distributed optimizer shards over (dense DP, expert DP), if any.
    Parameters no optimizer holds (not trained: a LoRA policy's frozen base) are their own, full, copy.
    """
    full: dict[torch.nn.Parameter, torch.Tensor] = {}
    for opt in _chained(optimizer):
        if hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                for p, main in zip(mg, fg, strict=True):
                    full[p] = main
    params = list(model.parameters()) if params is None else list(params)
    group_of, shards = shard_layout(optimizer)
    gathered = assemble_shards(params, group_of, shards, device)
    missing = [p for p, g in zip(params, gathered, strict=True) if g is None and p.dtype != torch.float32]
    missing = [p for p in missing if p not in full and p.requires_grad]  # frozen (LoRA base): itself
    if missing:
        p = missing[0]
        raise RuntimeError(f"no fp32 main parameter found for a {p.dtype} parameter of shape {list(p.shape)}")
    return [g if g is not None else full.get(p, p).float() for g, p in zip(gathered, params, strict=True)]


def assemble_shards(params, group_of: dict, shards, device) -> list[torch.Tensor | None]:
    """Full fp32 tensors from disjoint flattened shards: one flat buffer and one all-reduce per group.

    ``params``: every parameter, in an order all ranks share; ``group_of[p]``: the group whose ranks
    together hold ``p``'s shards (``None`` comes back for a ``p`` without one); ``shards``: this rank's
    ``(p, shard [n], range in p.view(-1))``. The ranks of a group own disjoint ranges and leave the rest
    zero, so the sum is exact. Groups are reduced in the order of their first parameter, the same on
    every rank of a group.
    """
    by_group: dict = {}
    for p in params:
        if p in group_of:
            by_group.setdefault(group_of[p], []).append(p)
    where: dict[torch.nn.Parameter, tuple[torch.Tensor, int]] = {}
    for members in by_group.values():
        flat = torch.zeros(sum(p.numel() for p in members), dtype=torch.float32, device=device)
        start = 0
        for p in members:
            where[p] = (flat, start)
            start += p.numel()
    for p, shard, rng in shards:
        flat, s = where[p]
        flat[s + rng.start : s + rng.stop] = shard.view(-1)
    for group, members in by_group.items():
        if dist.get_world_size(group) > 1:
            dist.all_reduce(where[members[0]][0], group=group)
    out: list[torch.Tensor | None] = []
    for p in params:
        flat, s = where.get(p, (None, 0))
        out.append(None if flat is None else flat[s : s + p.numel()].view(p.shape))
    return out
