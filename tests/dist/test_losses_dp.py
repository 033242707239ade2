"""The routed SRPO loss and its gradient do not depend on DP size, micro-batches or TP size (gloo).

Every configuration runs the real flow on its ranks — route → score_student / score_teacher on the
rank's vocabulary shard → ``global_normalizers`` over the DP group → ``routed_loss`` per micro-batch —
and the summed loss and the reassembled [T, V] gradient must equal the single-process result (to
rounding) and the float64 full-vocabulary reference. ``<mode>+seq`` runs the mode under
``loss.aggregation: seq_mean_token_mean`` (each DP rank's samples weighted by 1/|y_i|, N_seq reduced over DP;
two micro-batches cut a sample in the middle).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from srpo_megatron.config import LossConfig
from srpo_megatron.losses import global_normalizers, routed_loss
from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.losses_reference import ref_routed_loss, rel_err
from tests.helpers.losses_scenario import build_batch, group_slice, make_problem, ref_cfg, vocab_shard

SEED = 21


def _cfg(mode):
    """``mode`` is a loss mode, or ``<mode>+seq`` for it under ``loss.aggregation: seq_mean_token_mean``."""
    mode, _, seq = mode.partition("+")
    aggregation = "seq_mean_token_mean" if seq else "token_mean"
    return LossConfig(mode=mode, top_k=4, temperature=0.9, entropy_coef=0.01, aggregation=aggregation)


def _run(prob, cfg, tp_rank, tp, tp_group, dp_rank, dp, dp_group, n_micro):
    """One rank's share: (summed loss, global token rows, gradient rows of the local vocab shard)."""
    n_groups = len(prob.rewards)
    part, rows = group_slice(prob, dp_rank * n_groups // dp, (dp_rank + 1) * n_groups // dp)
    student = vocab_shard(part.student, tp_rank, tp)
    teacher = vocab_shard(part.teacher, tp_rank, tp)
    batch = build_batch(part, cfg, student, teacher, group=tp_group)
    micro = batch.split(n_micro)
    norm = global_normalizers(micro, cfg.beta, group=dp_group)
    total, grads, start = torch.zeros((), dtype=torch.float64), [], 0
    for mb in micro:
        x = student[start : start + len(mb)].clone().requires_grad_()
        start += len(mb)
        loss, _ = routed_loss(x, mb, norm, cfg, group=tp_group)
        loss.backward()
        total += loss.detach()
        grads.append(x.grad)
    return total, rows, torch.cat(grads)


def _worker(rank, world, layouts, modes):
    prob = make_problem(seed=SEED)
    out = {}
    for tp, dp, n_micro in layouts:
        assert tp * dp == world
        # Every rank creates every group, in the same order (a torch.distributed requirement).
        tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
        dp_rank, tp_rank = divmod(rank, tp)
        tp_group = tp_groups[dp_rank] if tp > 1 else None
        for mode in modes:
            out[(tp, dp, n_micro, mode)] = _run(
                prob, _cfg(mode), tp_rank, tp, tp_group, dp_rank, dp, dp_groups[tp_rank], n_micro
            )
    return out


def _assemble(results, world, tp, key, t, v):
    loss = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros(t, v, dtype=torch.float64)
    shard = v // tp
    for rank in range(world):
        total, rows, g = results[rank][key]
        dp_rank, tp_rank = divmod(rank, tp)
        if tp_rank == 0:
            loss += total
        else:  # TP ranks replicate the loss
            assert torch.equal(total, results[dp_rank * tp][key][0])
        grad[rows, tp_rank * shard : (tp_rank + 1) * shard] = g
    return float(loss), grad


def _single(mode):
    prob = make_problem(seed=SEED)
    return _worker_local(prob, _cfg(mode))


def _worker_local(prob, cfg):
    total, _rows, g = _run(prob, cfg, 0, 1, None, 0, 1, None, 1)
    return float(total), g


def _reference(mode):
    prob = make_problem(seed=SEED)
    x = prob.student.clone().requires_grad_()
    loss = ref_routed_loss(
        x, prob.teacher, prob.rewards, prob.sample_of_token, prob.response_ids, prob.mask,
        prob.old_logp, prob.rollout_logp, ref_cfg(_cfg(mode)), prob.ref_logp,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), g


CASES = {
    2: (
        [(1, 2, 1), (1, 2, 2), (2, 1, 1)],
        ["srpo", "sdpo", "advantage_mix", "srpo+seq", "grpo+seq", "sdpo+seq"],
    ),
    4: ([(2, 2, 2), (1, 4, 1), (4, 1, 2)], ["srpo"]),
}


@pytest.mark.parametrize("world", [2, 4])
def test_routed_loss_invariant_to_dp_micro_batches_and_tp(world):
    layouts, modes = CASES[world]
    results = run_distributed(_worker, world, layouts, modes, timeout=240)
    prob = make_problem(seed=SEED)
    t, v = prob.student.shape
    for mode in modes:
        base_loss, base_grad = _single(mode)
        ref_loss, ref_grad = _reference(mode)
        assert abs(base_loss - ref_loss) <= 1e-6 * abs(ref_loss) and rel_err(base_grad, ref_grad) < 1e-6
        for tp, dp, n_micro in layouts:
            loss, grad = _assemble(results, world, tp, (tp, dp, n_micro, mode), t, v)
            assert abs(loss - base_loss) <= 1e-12 * abs(base_loss), (mode, tp, dp, n_micro)
            assert rel_err(grad, base_grad) < 1e-12, (mode, tp, dp, n_micro)
