"""A small SRPO batch (test support, no tests): raw tensors, and the TokenBatch the trainer would build.

Groups cover every routing case: mixed, all-wrong, single-correct, all-correct. Ratios and TIS weights
are spread so that PPO clipping, dual-clip and the TIS cap all occur. ``build_batch`` runs the real
scoring pipeline (route → routing_masks → score_student → score_teacher) on full or sharded logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srpo_megatron.config import LossConfig
from srpo_megatron.losses import (
    TokenBatch,
    group_advantages,
    route,
    routing_masks,
    score_student,
    score_teacher,
    sequence_weights,
)
from tests.helpers.losses_reference import RefCfg, ref_log_softmax

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]


@dataclass
class Problem:
    rewards: list[list[float]]
    sample_of_token: list[int]  # [T]
    response_ids: torch.Tensor  # [T]
    mask: torch.Tensor  # [T] bool
    student: torch.Tensor  # [T, V] float64
    teacher: torch.Tensor  # [T, V] float64
    old_logp: torch.Tensor  # [T]
    rollout_logp: torch.Tensor  # [T]
    ref_logp: torch.Tensor  # [T]


def make_problem(seed: int = 0, vocab: int = 96, rewards=REWARDS) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    n_samples = len(rewards) * len(rewards[0])
    lengths = torch.randint(2, 5, (n_samples,), generator=gen).tolist()
    sample_of_token = [s for s, n in enumerate(lengths) for _ in range(n)]
    t = len(sample_of_token)
    mask = torch.ones(t, dtype=torch.bool)
    mask[torch.randperm(t, generator=gen)[:3]] = False  # a few padding rows
    student = 2.0 * torch.randn(t, vocab, generator=gen, dtype=torch.float64)
    teacher = student + torch.randn(t, vocab, generator=gen, dtype=torch.float64)
    response_ids = torch.randint(0, vocab, (t,), generator=gen)
    perturbed = student + 0.6 * torch.randn(t, vocab, generator=gen, dtype=torch.float64)
    old = ref_log_softmax(perturbed).gather(1, response_ids[:, None]).squeeze(1)
    rollout = old + 0.5 * torch.randn(t, generator=gen, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(t, generator=gen, dtype=torch.float64)
    return Problem(rewards, sample_of_token, response_ids, mask, student, teacher, old, rollout, ref)


def ref_cfg(cfg: LossConfig) -> RefCfg:
    keys = RefCfg.__dataclass_fields__
    return RefCfg(**{k: getattr(cfg, k) for k in keys})


def build_batch(
    prob: Problem,
    cfg: LossConfig,
    student_shard: torch.Tensor,
    teacher_shard: torch.Tensor,
    group=None,
    dtype: torch.dtype = torch.float64,
) -> TokenBatch:
    """The trainer's scoring flow on (sharded) logits [T, V/P]; per-sample fields broadcast to tokens."""
    rewards = torch.tensor(prob.rewards, dtype=torch.float64)
    routing = route(rewards, cfg.success_threshold)
    grpo_s, sdpo_s, teacher_s = routing_masks(routing, cfg.mode)
    tok = torch.tensor(prob.sample_of_token)
    adv = group_advantages(rewards, cfg.std_normalize, cfg.std_eps).flatten()[tok]
    sdpo = sdpo_s.flatten()[tok]
    needs_teacher = teacher_s.flatten()[tok] & prob.mask
    student_score = score_student(
        student_shard, prob.response_ids, sdpo & prob.mask, cfg.top_k, group, cfg.temperature
    )
    teacher_score = score_teacher(
        teacher_shard, student_score.topk_ids, group, cfg.temperature, response_ids=prob.response_ids
    )
    # Only teacher-routed rows carry teacher data (the trainer runs the teacher on those samples only).
    keep = needs_teacher[:, None]
    return TokenBatch(
        response_ids=prob.response_ids,
        mask=prob.mask,
        advantages=adv.to(dtype),
        grpo=grpo_s.flatten()[tok],
        sdpo=sdpo,
        old_logp=prob.old_logp.to(dtype),
        rollout_logp=prob.rollout_logp.to(dtype),
        ref_logp=prob.ref_logp.to(dtype),
        topk_ids=student_score.topk_ids,
        teacher_logp=torch.where(keep, teacher_score.logp, 0.0).to(dtype),
        teacher_entropy=torch.where(needs_teacher, teacher_score.entropy, 0.0).to(dtype),
        teacher_token_logp=torch.where(needs_teacher, teacher_score.token_logp, 0.0).to(dtype),
        teacher=needs_teacher,
        seq_weight=sequence_weights(prob.mask, sample_offsets(prob))
        if cfg.aggregation == "seq_mean_token_mean"
        else None,
    )


def sample_offsets(prob: Problem) -> list[int]:
    """[N + 1] row offsets of the samples (``sample_of_token`` is sorted: a sample's rows are contiguous)."""
    n = len(prob.rewards) * len(prob.rewards[0])
    counts = [0] * n
    for s in prob.sample_of_token:
        counts[s] += 1
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def group_slice(prob: Problem, lo: int, hi: int) -> tuple[Problem, torch.Tensor]:
    """Prompt groups [lo, hi) of ``prob`` (what one data-parallel rank holds) and their token rows [T']."""
    g = len(prob.rewards[0])
    rows = torch.tensor([lo * g <= s < hi * g for s in prob.sample_of_token]).nonzero().squeeze(1)
    part = Problem(
        rewards=prob.rewards[lo:hi],
        sample_of_token=[prob.sample_of_token[r] - lo * g for r in rows.tolist()],
        response_ids=prob.response_ids[rows],
        mask=prob.mask[rows],
        student=prob.student[rows],
        teacher=prob.teacher[rows],
        old_logp=prob.old_logp[rows],
        rollout_logp=prob.rollout_logp[rows],
        ref_logp=prob.ref_logp[rows],
    )
    return part, rows


def vocab_shard(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s slice [..., V/size] of full logits (megatron's contiguous vocabulary partition)."""
    v = x.shape[-1] // size
    return x[..., rank * v : (rank + 1) * v].contiguous()
