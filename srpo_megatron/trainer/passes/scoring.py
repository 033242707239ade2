"""The no-grad scoring pass (method §3) over one rollout batch: π_old, the student's top-K ids, and the
teacher on the samples that need it.

Fidelity fix: this runs once per rollout batch, before its first optimizer step. With several
mini-batches per rollout batch (the paper's GRPO setting uses 4) every mini-batch's PPO ratio is taken
against the same π_old, so the clip bounds the drift across the whole batch, as in verl; scoring each
mini-batch just before its own step would start every mini-batch at ratio 1. The teacher (and, for the
trust-region teacher, the student logits it mixes in) are scored at the same point.

Results are written into one ``ScoredBatch`` on the runtime's device (last pipeline stage only). With
context parallelism each CP rank scores the rows it holds and the CP group gathers them after each pass
(``trainer/microbatches/context_parallel.py``): the teacher needs the student's top-K ids of rows another CP
rank may have scored, and the training pass needs every row on every CP rank.

Parity (``rollout.parity_top_k`` = K > 0): the student pass also takes π_old at the engine's top-K ids of
every row (the same vocab-parallel gather as the sampled token) and logs the per-token KL(engine‖trainer)
over them plus a tail bucket (``losses/parity.py``): ``logprob/topk_kl_mean`` and ``logprob/topk_kl_max``.

Off-policy (``loss.is_correction: mis``, ``loss.mask_stale_tokens``): once π_old is known on every row, the
rows the correction rejects are cleared from the batch's mask (``losses.apply_rejections``), before any
mini-batch's normalisers are counted. Staleness is ``trainer_version`` minus each token's version, bounded
by ``rollout.off_policy_steps``.

``loss.aggregation: seq_mean_token_mean``: each row's 1/|y_i| (``losses.sequence_weights``) is fixed here,
from the sample's full rows after the rejections, so a sample split over micro-batches or CP ranks still
divides by its whole length.
"""

from __future__ import annotations

import contextlib
import time

import torch

from srpo_megatron.losses import apply_rejections, score_student, score_teacher, sequence_weights
from srpo_megatron.losses.parity import topk_parity_kl
from srpo_megatron.ops import deferred_checks
from srpo_megatron.trainer.microbatches import context_parallel as cpar
from srpo_megatron.trainer.microbatches.batches import (
    micro_batches_for,
    row_offsets,
    sample_tokens,
    student_sequences,
    teacher_sequences,
)
from srpo_megatron.trainer.microbatches.lockstep import lockstep
from srpo_megatron.trainer.microbatches.moe_replay import moe_replay_for
from srpo_megatron.trainer.microbatches.output_rows import Rows, mix_rows
from srpo_megatron.trainer.microbatches.schedule import run_schedule
from srpo_megatron.trainer.observe.stats import reduce_stats
from srpo_megatron.trainer.passes.parity import EngineTopK, engine_top_k, parity_stats
from srpo_megatron.trainer.state.policy import Policy
from srpo_megatron.trainer.step_types import Sample, ScoredBatch, StepStats


@torch.no_grad()
def scoring_pass(policy: Policy, samples: list[Sample], *, trainer_version: int | None = None) -> ScoredBatch:
    """Student scoring of every sample and teacher scoring of ``needs_teacher`` samples (collective).

    ``trainer_version``: the version of the policy's weights now (``TrainerState.weight_version``), for
    ``loss.mask_stale_tokens``; None = unknown (no token is marked stale).
    """
    t0 = time.monotonic()
    cfg, g, dev = policy.cfg, policy.groups, policy.device
    mbs = cfg.train.micro_batch_size
    offsets = row_offsets(samples)
    tokens = (
        sample_tokens(
            samples,
            cfg.loss.top_k,
            dev,
            trainer_version=trainer_version,
            max_staleness=cfg.rollout.off_policy_steps,
        )
        if g.is_last_stage
        else None
    )
    seqs = student_sequences(samples)
    budget = cfg.train.max_tokens_per_micro_batch
    layout = cpar.micro_batch_layout(g, policy.tconfig.sequence_parallel)

    def build(pass_seqs):
        return micro_batches_for(pass_seqs, mbs, budget, g.pp_size, dev, **layout)

    micro = lockstep(build(seqs), g, build)
    scored = ScoredBatch(samples, offsets, tokens, StepStats())
    with deferred_checks.deferred() as checks:  # the token-id checks: one host sync for the pass
        engine_top, moe_stats, rejections = _student_pass(policy, scored, seqs, micro)
        t_student = time.monotonic() - t0
        teacher_runs = _teacher_pass(policy, scored, build)
    deferred_checks.raise_pending(checks)
    stats = StepStats(
        teacher_runs=float(teacher_runs),
        score_s=t_student,
        teacher_s=time.monotonic() - t0 - t_student,
        **rejections,
    )
    stats = reduce_stats([stats, parity_stats(engine_top)])
    stats = stats.counted_once(g.is_last_stage and g.tp_rank == 0 and g.cp_rank == 0)
    scored.stats = reduce_stats([stats, moe_stats])
    return scored


def _student_pass(
    policy: Policy, scored: ScoredBatch, seqs: list, micro: list
) -> tuple[EngineTopK | None, StepStats, dict[str, float]]:
    """The student's forward over ``micro``: π_old, its top-K ids (and the parity KL) into ``scored.tokens``,
    gathered over CP; then the off-policy rejections and the sequence weights. Answers the engine's top-K
    (parity, or None), the MoE router stats and the rejection counts."""
    cfg, g, dev = policy.cfg, policy.groups, policy.device
    k_top, lc, tokens, samples = cfg.loss.top_k, cfg.loss, scored.tokens, scored.samples
    chunk = lc.chunk_tokens or None
    # rollout.parity_top_k: the engine's top-K per row, and the trainer's KL to it (trainer/passes/parity.py)
    engine_top = engine_top_k(samples, cfg.rollout.parity_top_k, dev) if g.is_last_stage else None

    def on_student(row_logits: Rows, k: int) -> None:
        rows = micro[k].local(scored.row_index([i for i in micro[k].members if i is not None]))
        at = None if engine_top is None else engine_top.ids[rows]
        score = score_student(
            row_logits, tokens.response_ids[rows], tokens.sdpo[rows], k_top, g.tp, lc.temperature, chunk, at
        )
        tokens.old_logp[rows] = score.old_logp.float()
        tokens.topk_ids[rows] = score.topk_ids
        if engine_top is not None and score.at_ids is not None:
            engine_top.kl[rows] = topk_parity_kl(engine_top.logp[rows], score.at_ids)

    # MoE: expert replay (rollout.routing_replay) and the router metrics; the teacher below is not replayed.
    moe = moe_replay_for(policy, seqs, samples, micro, record=True)
    policy.ddp.eval()
    with moe or contextlib.nullcontext():
        hook = None if moe is None else moe.before_forward
        run_schedule(policy.ddp, micro, on_student, policy.head, forward_only=True, before_forward=hook)
    policy.ddp.train()
    moe_stats = StepStats() if moe is None else StepStats.from_moe(moe.summary())
    rejections: dict[str, float] = {}
    if g.is_last_stage:
        cpar.gather_rows(tokens, cpar.STUDENT_FIELDS, g.cp)
        if engine_top is not None:
            cpar.gather_tensor(engine_top.kl, g.cp)
        if lc.rejects_tokens:  # every CP rank holds every row now, so all of them reject the same ones
            rejections = {k: float(v) for k, v in apply_rejections(tokens, lc, scored.offsets).items()}
        if lc.aggregation == "seq_mean_token_mean":  # 1/|y_i| from each sample's full rows, after rejections
            tokens.seq_weight = sequence_weights(tokens.mask, scored.offsets)
    return engine_top, moe_stats, rejections


def _teacher_pass(policy: Policy, scored: ScoredBatch, build) -> int:
    """The teacher's forward over the ``needs_teacher`` samples (the trust-region teacher mixes in the
    student's logits of the same prompts): its log-probs at the student's top-K ids, entropy and
    sampled-token log-prob into ``scored.tokens``, gathered over CP. Answers the teacher forwards run."""
    cfg, g = policy.cfg, policy.groups
    lc, tokens, samples = cfg.loss, scored.tokens, scored.samples
    chunk = lc.chunk_tokens or None
    teacher_runs = 0
    wanted = [i for i, s in enumerate(samples) if s.needs_teacher]
    t_micro = []
    if policy.teacher is not None:  # EP > 1: a DP rank without teacher samples still runs fillers
        t_seqs = teacher_sequences([samples[i] for i in wanted])
        t_micro = lockstep(build(t_seqs) if wanted else [], g, build)
    if not t_micro:
        return teacher_runs
    mix = cfg.teacher.kind == "trust_region"
    student_logits: dict[int, Rows] = {}  # fused: hidden rows [T, H], not [T, V/TP] logits
    if mix:  # log q = (1−α) log q_ref + α log q_θ  ⇔  logits mix (the log-normaliser is shared)
        policy.ddp.eval()
        keep = lambda r, k: student_logits.__setitem__(k, r)  # noqa: E731
        run_schedule(policy.ddp, t_micro, keep, policy.head, forward_only=True)
        policy.ddp.train()

    def on_teacher(row_logits: Rows, k: int) -> None:
        nonlocal teacher_runs
        if mix:
            row_logits = mix_rows(row_logits, student_logits[k], cfg.teacher.ema_alpha)
        members = [wanted[j] for j in t_micro[k].members if j is not None]
        teacher_runs += len(members)
        every = scored.row_index(members)
        rows = t_micro[k].local(every)  # the teacher's split of these tokens, not the student's
        # Rows of samples that need a teacher but take no SDPO loss (advantage_mix) hold top-K ids 0:
        # only their sampled-token log-prob is used.
        ts = score_teacher(
            row_logits, tokens.topk_ids[rows], g.tp, lc.temperature, tokens.response_ids[rows], chunk
        )
        tokens.teacher_logp[rows] = ts.logp.float()
        tokens.teacher_entropy[rows] = ts.entropy.float()
        tokens.teacher_token_logp[rows] = ts.token_logp.float()
        tokens.teacher[every] = True

    with policy.offload.teacher_on_device(), _teacher_weights(policy.teacher):
        assert policy.teacher_head is not None  # built with the teacher
        run_schedule(policy.teacher.module, t_micro, on_teacher, policy.teacher_head, forward_only=True)
    if g.is_last_stage:
        cpar.gather_rows(tokens, cpar.TEACHER_FIELDS, g.cp)
    return teacher_runs


def _teacher_weights(teacher) -> contextlib.AbstractContextManager:
    """A LoRA policy's teacher runs the student's module with its EMA adapters swapped in (no autograd
    graph on the student's adapters); other teachers have their own module."""
    if getattr(teacher, "shares_module", False):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(teacher.swapped_in())
        return stack
    return contextlib.nullcontext()
