"""The training pass: one optimizer step per mini-batch of a scored rollout batch (method §2 objective).

Each mini-batch's micro-batches share the global normalisers (token count, |Ω_sdpo|, Σw̃ over all its
micro-batches and the DP group), so the summed micro-batch losses equal the objective L of that
mini-batch. Megatron divides each loss by the number of micro-batches and DDP averages gradients over
DP; the ``num_microbatches · dp_size`` factor undoes both so gradients are summed (see ``schedule.py``).
With context parallelism each CP rank's loss covers its own rows (normalised by the global counts, taken
from the full rows every CP rank holds and reduced over DP only); megatron multiplies the loss by CP and
DDP averages over DP×CP, so the same factor sums the CP ranks' partial gradients too
(``trainer/microbatches/context_parallel.py``).
A step whose gradients or loss are non-finite on any rank is skipped on every rank (weights untouched)
when ``train.skip_nonfinite`` is set. ``StepStats.stepped`` says whether some optimizer step of the batch
was applied from finite gradients; only then does the EMA teacher follow (``Policy.update_teacher_after``).
The LR schedule advances once per rollout batch (``policy.py``).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from srpo_megatron.losses import Normalizers, global_normalizers, routed_loss
from srpo_megatron.models import performance as perf_choice
from srpo_megatron.ops import deferred_checks
from srpo_megatron.trainer.microbatches import context_parallel as cpar
from srpo_megatron.trainer.microbatches.batches import micro_batches_for, student_sequences
from srpo_megatron.trainer.microbatches.lockstep import lockstep
from srpo_megatron.trainer.microbatches.moe_replay import moe_replay_for
from srpo_megatron.trainer.microbatches.output_rows import Rows
from srpo_megatron.trainer.microbatches.schedule import run_schedule
from srpo_megatron.trainer.observe.stats import reduce_stats
from srpo_megatron.trainer.state.policy import Policy
from srpo_megatron.trainer.step_types import ScoredBatch, StepStats


def learn(policy: Policy, scored: ScoredBatch, mini_batches: int) -> StepStats:
    """Collective: ``mini_batches`` optimizer steps over ``scored``, then one LR-schedule step."""
    t0 = time.monotonic()
    stats = [train_mini_batch(policy, mini) for mini in scored.mini_batches(mini_batches)]
    policy.step_schedule()
    return reduce_stats([*stats, StepStats(train_s=time.monotonic() - t0)])


def train_mini_batch(policy: Policy, scored: ScoredBatch) -> StepStats:
    """One optimizer step on ``scored`` (this DP rank's share of a mini-batch)."""
    cfg, g = policy.cfg, policy.groups
    seqs = student_sequences(scored.samples)
    t = cfg.train
    layout = cpar.micro_batch_layout(g, policy.tconfig.sequence_parallel)

    def build(pass_seqs):
        return micro_batches_for(
            pass_seqs, t.micro_batch_size, t.max_tokens_per_micro_batch, g.pp_size, policy.device, **layout
        )

    micro = build(seqs)
    last = g.is_last_stage
    batches = [scored.micro_tokens(mb.members) for mb in micro] if last else []  # all rows, every CP rank
    # EP > 1: fillers (no rows, so never in ``batches`` nor scored) keep the expert collectives in step
    micro = lockstep(micro, g, build)
    normalizers = (
        global_normalizers(batches, cfg.loss.beta, g.dp if g.dp_size > 1 else None)
        if last
        else Normalizers(1.0, 0.0, 0.0)
    )
    per_micro: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []  # on device until the step's sync
    scale = len(micro) * g.dp_size

    def on_rows(rows: Rows, k: int) -> torch.Tensor:
        loss, metrics = routed_loss(rows, micro[k].local_tokens(batches[k]), normalizers, cfg.loss, g.tp)
        per_micro.append((metrics, loss.detach()))
        return loss * scale

    policy.ddp.zero_grad_buffer()
    policy.optimizer.zero_grad()
    if last and normalizers.num_tokens <= 0:
        raise RuntimeError("the training batch has no response tokens; check rollout.max_new_tokens")
    moe = moe_replay_for(policy, seqs, scored.samples, micro, record=False)  # MoE expert replay
    with moe or contextlib.nullcontext(), deferred_checks.deferred() as checks:  # checked at the sync
        hook = None if moe is None else moe.before_forward
        run_schedule(policy.ddp, micro, on_rows, policy.head, forward_only=False, before_forward=hook)
    finite, micro_stats = _finite_and_stats(policy.model, per_micro, policy.device, checks)  # the sync
    out = reduce_stats(micro_stats)
    if last:  # each CP rank's sums cover its own rows
        out = cpar.reduce_stats_over(out, g.cp, policy.device)
    skipped, stepped, grad_norm = 0.0, 0.0, float("nan")
    if finite or not cfg.train.skip_nonfinite:
        ok, norm, _ = policy.optimizer.step()
        perf_choice.finish_param_gather(policy.ddp)  # full weights before EMA / sync / save read them
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = 0.0 if ok and math.isfinite(grad_norm) else 1.0
        # an update from finite gradients (rank-consistent: ``finite`` and ``ok`` are agreed by all ranks)
        stepped = 1.0 if ok and finite else 0.0
    else:
        skipped = 1.0
        policy.optimizer.zero_grad()
    out.grad_norm_sum, out.optimizer_steps = grad_norm, 1.0
    out.skipped, out.stepped, out.lr = skipped, stepped, policy.lr
    return out.counted_once(last and g.tp_rank == 0 and g.cp_rank == 0)


def _finite_and_stats(
    model: torch.nn.Module,
    per_micro: list[tuple[dict[str, torch.Tensor], torch.Tensor]],
    device: torch.device,
    checks: deferred_checks.Pending = (),
) -> tuple[bool, list[StepStats]]:
    """Collective: whether every rank's gradients and micro-batch losses are finite, and each micro-batch's
    stats, with ONE host sync for the step (a ``tolist``), however many parameters and micro-batches.

    Each rank's flag and losses stay on device; the flag is MAX-reduced over all ranks as a device tensor
    (NCCL on GPU), then it and every micro-batch's metrics and loss, cast to float64 (exact for the fp32
    losses and the float64/integer counts), come to the host together: the same Python floats that
    ``float(tensor)`` gave per value. A loss sum over finite fp32 losses cannot overflow in float64, so
    "every micro-batch loss finite" is "the step's loss finite". Megatron's own found-inf check
    (``MixedPrecisionOptimizer.prepare_grads``) runs only with an fp16 grad scaler, and its bf16/fp32
    ``optimizer.step()`` applies non-finite gradients; hence the check before it. The ``checks`` recorded
    during the schedule (``ops/deferred_checks.py``: e.g. a token id outside the vocabulary) come back in
    the same sync and raise their message here, before any optimizer step.
    """
    ok = _grads_finite(model, device)
    if per_micro:
        ok = ok & torch.stack([torch.isfinite(loss) for _, loss in per_micro]).all()
    bad = (~ok).to(torch.float64).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    exact = lambda v: v.detach().to(torch.float64).reshape(1)  # noqa: E731
    packed = [bad, *(exact(v) for metrics, loss in per_micro for v in (*metrics.values(), loss))]
    flat = torch.cat([*deferred_checks.flags(checks), *packed]).tolist()  # the host sync
    deferred_checks.raise_failed(checks, flat[: len(checks)])
    flat = flat[len(checks) :]
    stats, at = [], 1
    for metrics, _ in per_micro:
        fields = dict(zip(metrics, flat[at : at + len(metrics)], strict=True))
        stats.append(StepStats.from_metrics(fields, loss=flat[at + len(metrics)]))
        at += len(metrics) + 1
    return flat[0] == 0.0, stats


def _grads_finite(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """Whether every gradient of ``model`` is finite, as a 0-dim bool on device (no host sync)."""
    flags = []
    for p in model.parameters():
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is not None:
            flags.append(torch.isfinite(grad).all())
    if not flags:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack(flags).all()
