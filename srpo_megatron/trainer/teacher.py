"""The self-teacher (method §1.4): EMA of the student, frozen, or the trust-region mix, with an fp32 copy.

Fidelity fix: the EMA is kept in fp32. The teacher module runs the forward in the policy's dtype, but its
weights are a cast of an fp32 copy θ′ that is updated from the optimizer's fp32 *main* parameters θ:

    θ′ ← (1 − α)·θ′ + α·θ        (fp32, then θ′ is cast into the bf16 module for the forward)

Updating a bf16 teacher in place rounds α·(θ − θ′) away until the gap is ~10 ulp, so the teacher nearly
freezes (tests/unit/test_ema_teacher.py plants that update and shows it misses the float64 EMA); the
SDPO reference keeps its teacher in fp32 as well. In fp32 runs the module's own parameters are the copy.

Main parameters come from megatron's optimizer: with bf16 params the mixed-precision optimizer holds
fp32 copies (``fp32_from_float16_groups``); the distributed optimizer holds only this DP rank's shard of
each (``shard_fp32_from_float16_groups``), so ``fp32_main_params`` all-reduces the disjoint shards into a
full fp32 copy per rank (``parallel.teacher_fp32: full``; ``sharded`` keeps only this rank's shard:
trainer/ema_shard.py). Checkpoints save the fp32 copy (trainer/ema_shard.py), so a resume restores it
exactly; checkpoints written before that restart it from the saved teacher module (one rounding).
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


@torch.no_grad()
def fp32_main_params(optimizer, model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    """The optimizer's fp32 main copy of every parameter of ``model`` (module order, full shape).

    Collective over the distributed optimizer's DP group when it holds bf16 shards.
    """
    full: dict[torch.nn.Parameter, torch.Tensor] = {}
    shards = []
    distributed = False
    for opt in _chained(optimizer):
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            distributed = True
            for mg, sg in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True):
                for p, shard in zip(mg, sg, strict=True):
                    shards.append(
                        (p, shard, opt._get_model_param_range_map(p)["param"], opt.data_parallel_group)
                    )
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                for p, main in zip(mg, fg, strict=True):
                    full[p] = main
    params = list(model.parameters())
    if distributed:
        return _gather_shards(params, shards, device)
    missing = [p for p in params if p.dtype != torch.float32 and p not in full]
    if missing:
        p = missing[0]
        raise RuntimeError(f"no fp32 main parameter found for a {p.dtype} parameter of shape {list(p.shape)}")
    return [full.get(p, p).float() for p in params]


def _gather_shards(params, shards, device) -> list[torch.Tensor]:
    """Assemble the distributed optimizer's disjoint fp32 shards into one flat buffer, all-reduced over DP."""
    from megatron.core import parallel_state as ps

    starts = [0]
    for p in params:
        starts.append(starts[-1] + p.numel())
    flat = torch.zeros(starts[-1], dtype=torch.float32, device=device)
    where = {p: i for i, p in enumerate(params)}
    group = shards[0][3] if shards else ps.get_data_parallel_group(with_context_parallel=True)
    for p, shard, rng, _ in shards:
        s = starts[where[p]]
        flat[s + rng.start : s + rng.end] = shard.view(-1)
    for i, p in enumerate(params):
        # fp32 model params are full replicas (the optimizer writes them back after each step): only DP
        # rank 0 adds them so the sum stays exact. bf16 params without a shard here are owned elsewhere.
        if p.dtype == torch.float32 and dist.get_rank(group) == 0:
            flat[starts[i] : starts[i + 1]] = p.detach().view(-1)
    dist.all_reduce(flat, group=group)
    return [flat[starts[i] : starts[i + 1]].view(p.shape) for i, p in enumerate(params)]
