"""What flows through one training step, as types (a leaf: stdlib and torch only).

    engines ── Completion ──▶ rank 0: route_groups ── Sample (frozen) ──▶ RolloutBatch
        ──▶ each DP replica its share (batch_shipping) ──▶ scoring: ScoredBatch ──▶ learning: StepStats
        ──▶ rank 0: step metrics (declared in ``METRICS``) ──▶ TrainerState (the checkpoint's state)

- :class:`Sample`: one rollout with its reward, advantage, routing and teacher context, built once on
  rank 0 (``trainer/collect/sample_routing.route_groups``) and never changed afterwards.
- :class:`RolloutBatch`: a step's samples (on a trainer rank: its DP share) and rank 0's batch metrics.
- :class:`ScoredBatch`: a rank's share after the scoring pass, the tensors the training pass consumes.
- :class:`StepStats`: what a rank measured in a step; every field declares its reduction.
- :class:`TrainerState`: the step counter, weight version, data cursor and history a checkpoint carries.
- :data:`METRICS`: every logged metric's name, reduction and meaning, in one place. The logger refuses a
  name that is not declared here; ``merge_metrics`` refuses one name produced twice in a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # the flat per-token tensors (losses/); only the type is needed here
    from srpo_megatron.losses import TokenBatch

Reduction = Literal["mean", "sum", "max", "min", "last"]
SUM: Reduction = "sum"
MAX: Reduction = "max"
MIN: Reduction = "min"
MEAN: Reduction = "mean"
LAST: Reduction = "last"


def reduce_values(how: Reduction, values: Iterable[float]) -> float:
    """``values`` combined by ``how`` (``sum`` of nothing is 0; the others need at least one value)."""
    vals = [float(v) for v in values]
    if how == SUM:
        return float(sum(vals))
    if not vals:
        raise ValueError(f"a {how} reduction needs at least one value")
    if how == MAX:
        return max(vals)
    if how == MIN:
        return min(vals)
    if how == MEAN:
        return sum(vals) / len(vals)
    if how == LAST:
        return vals[-1]
    raise ValueError(f"unknown reduction {how!r}; use one of sum, max, min, mean, last")


# ---------------------------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class Sample:
    """One rollout y_i of prompt group ``group`` (index ``member`` in the group), routed (method §1).

    Built once, with every field, by ``route_groups`` on rank 0; frozen afterwards.
    """

    group: int
    member: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logp: list[float]  # the engine's log-prob of each sampled token (TIS)
    reward: float = 0.0
    advantage: float = 0.0
    grpo: bool = True  # z^GRPO under the loss mode
    sdpo: bool = False  # z^SDPO under the loss mode
    needs_teacher: bool = False  # the teacher forward runs on this sample
    teacher_prompt_ids: list[int] | None = None  # teacher context (sibling's solution), method §1.4
    finish_reason: str = "stop"
    # multi-turn: 1 where response_ids[t] is the model's own (assistant) token, 0 for the tool/user
    # turns' tokens appended between turns (scored as context, never trained on); None = all the model's
    response_mask: list[int] | None = None
    # MoE: the engine's experts per forwarded position, [P + R - 1, layers, top_k] (or flat), small int
    # dtype; None when the engine reported none. Replayed by the policy (trainer/microbatches/moe_replay.py).
    routed_experts: torch.Tensor | None = None
    # Off-policy bookkeeping (trainer/collect/off_policy.py): a run-unique id (``dispatch/prompt/member``: the
    # resume tests count samples by it), the weight version the engine served when the sample was
    # dispatched (its oldest token's), and, for partial rollouts, each response token's version.
    uid: str = ""
    weight_version: int = 0
    token_versions: list[int] | None = None
    # Parity diagnostic (rollout.parity_top_k = K): the engine's top-K ids [R, K] int64 and their log-probs
    # [R, K] float32 per response token (Completion.top_ids / top_logprobs); None when not requested.
    engine_top_ids: torch.Tensor | None = None
    engine_top_logp: torch.Tensor | None = None


@dataclass
class RolloutBatch:
    """A step's routed samples and the batch metrics (``reward/*``, ``route/*``, ``rollout/*``, ...).

    On rank 0 before shipping: every sample of the step, in prompt then member order. After
    ``batch_shipping.ship_shares``: this rank's DP share (``batches.rank_share``, mini-batch-major), with the
    whole batch's metrics (rank 0 computed them over every sample).
    """

    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ScoredBatch:
    """This rank's share of one rollout batch after the scoring pass (method §3), ready for training.

    samples: N samples, mini-batch-major (mini-batch j is ``samples[j·N/M : (j+1)·N/M]``).
    offsets: N + 1 host ints; sample i owns rows ``[offsets[i], offsets[i + 1])`` of ``tokens``.
    tokens: ``TokenBatch`` over T = Σ response lengths rows on the runtime's device, holding π_old [T],
        the student's top-K ids [T, K] and the teacher's log-probs [T, K+1], entropy [T] and sampled-token
        log-prob [T]. Only the last pipeline stage sees logits, so other stages hold None.
    stats: the scoring pass's own stats (times, teacher forwards).
    """

    samples: list[Sample]
    offsets: list[int]
    tokens: TokenBatch | None
    stats: StepStats

    def select(self, start: int, end: int) -> ScoredBatch:
        """Samples ``[start, end)`` with their rows (views of ``tokens``, no copies)."""
        a, b = self.offsets[start], self.offsets[end]
        return ScoredBatch(
            self.samples[start:end],
            [o - a for o in self.offsets[start : end + 1]],
            None if self.tokens is None else self.tokens.slice(a, b),
            StepStats(),
        )

    def mini_batches(self, m: int) -> list[ScoredBatch]:
        """The ``m`` mini-batches (one optimizer step each) in order."""
        k = len(self.samples) // m
        return [self.select(j * k, (j + 1) * k) for j in range(m)]

    def micro_tokens(self, members: list[int | None]) -> TokenBatch:
        """Rows of a micro-batch's members in member order: views when they are consecutive (padded
        micro-batches), else gathered (packed micro-batches take members out of order)."""
        idx = [i for i in members if i is not None]
        assert self.tokens is not None
        if idx == list(range(idx[0], idx[-1] + 1)):
            return self.tokens.slice(self.offsets[idx[0]], self.offsets[idx[-1] + 1])
        return self.tokens.take(self.row_index(idx))

    def row_index(self, members: list[int]) -> torch.Tensor:
        """[R] rows of ``members`` (sample indices) in the flat layout, on the tokens' device."""
        assert self.tokens is not None
        rows = [r for i in members for r in range(self.offsets[i], self.offsets[i + 1])]
        return torch.tensor(rows, dtype=torch.long).to(self.tokens.mask.device)


# ------------------------------------------------------------------------------------------- step stats


def _stat(reduce: Reduction):
    return field(default=0.0, metadata={"reduce": reduce})


@dataclass
class StepStats:
    """Loss sums over tokens (divide by the matching ``*_tokens`` count), counts, maxima and phase times.

    Every field declares how it reduces (``sum`` or ``max``); ``stats.reduce_stats`` applies that rule
    over a rank's mini-batches (the learning pass) and over ranks (``step_metrics.gather_stats``). Sum
    fields are counted once per data-parallel rank: ranks that hold a copy of the same value (TP ranks
    other than 0, pipeline stages without logits) report them as 0 (``counted_once``). Max fields may be
    reported by every rank (identical values, or phase times where the slowest rank is the step's time).
    """

    loss: float = _stat(SUM)  # Σ of the routed losses (each micro-batch's share of L)
    tokens: float = _stat(SUM)  # valid response tokens
    grpo_tokens: float = _stat(SUM)  # tokens routed to the GRPO loss
    sdpo_tokens: float = _stat(SUM)  # tokens routed to the SDPO loss
    grpo_loss_sum: float = _stat(SUM)  # Σ per-token GRPO loss
    grpo_clipped_sum: float = _stat(SUM)  # GRPO tokens whose ratio was clipped
    sdpo_loss_sum: float = _stat(SUM)  # Σ per-token (weighted) SDPO loss
    divergence_sum: float = _stat(SUM)  # Σ per-token top-K divergence
    raw_weight_sum: float = _stat(SUM)  # Σ w̃ = exp(−β·H) over SDPO tokens (logged mean; routed_loss)
    raw_weight_sq_sum: float = _stat(SUM)  # Σ w̃² over SDPO tokens (logged spread)
    teacher_entropy_sum: float = _stat(SUM)  # Σ teacher entropy over SDPO tokens
    rollout_logp_gap_sum: float = _stat(SUM)  # Σ |log π_old − log π_rollout|
    rollout_logp_gap_max: float = _stat(MAX)  # max |log π_old − log π_rollout|
    topk_kl_sum: float = _stat(SUM)  # Σ per-token KL(engine‖trainer) over the engine's top-K (+ tail)
    topk_kl_max: float = _stat(MAX)  # max of that KL
    topk_kl_tokens: float = _stat(SUM)  # tokens with the engine's top-K (the mean's denominator)
    rejected_tokens: float = _stat(SUM)  # tokens dropped after scoring (loss.is_correction mis, stale)
    stale_tokens: float = _stat(SUM)  # of those, the stale ones (loss.mask_stale_tokens)
    is_zeroed_tokens: float = _stat(SUM)  # tokens kept in N_tokens with IS weight 0 (IcePop)
    teacher_runs: float = _stat(SUM)  # samples the teacher forward scored
    grad_norm_sum: float = _stat(SUM)  # Σ grad norm over optimizer steps (mean = / optimizer_steps)
    optimizer_steps: float = _stat(SUM)  # optimizer steps taken or skipped
    skipped: float = _stat(MAX)  # 1 if any optimizer step was skipped (non-finite)
    stepped: float = _stat(MAX)  # 1 if any optimizer step was applied (the EMA teacher follows only then)
    lr: float = _stat(MAX)  # learning rate of the step
    score_s: float = _stat(MAX)  # scoring pass (student), seconds
    teacher_s: float = _stat(MAX)  # teacher scoring, seconds
    train_s: float = _stat(MAX)  # training pass (all mini-batches), seconds
    # MoE router metrics of the scoring pass (trainer/microbatches/moe_replay.py): already reduced over all
    # ranks, so every rank reports the same value (MAX). moe = 1 marks an MoE policy, moe_compared = 1 that
    # the engine reported experts (the two top-k shares are only defined then).
    moe: float = _stat(MAX)  # 1 for an MoE policy
    moe_expert_load: float = _stat(MAX)  # worst layer's max/mean tokens per expert
    moe_router_entropy: float = _stat(MAX)  # mean per-token router entropy (nats)
    moe_compared: float = _stat(MAX)  # 1 when engine top-k was compared
    moe_topk_mismatch: float = _stat(MAX)  # share of (response token, layer) whose used top-k != engine's
    moe_router_disagreement: float = _stat(MAX)  # same for the trainer's own top-k (before replay)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, object], **extra: float) -> StepStats:
        """From ``routed_loss``'s metrics (0-dim tensors named like the fields) plus ``extra`` fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(metrics) - names)
        if unknown:
            raise KeyError(f"routed_loss metrics {unknown} have no StepStats field; add them to StepStats")
        return cls(**{k: float(v) for k, v in metrics.items()}, **extra)  # type: ignore[arg-type]

    @classmethod
    def from_moe(cls, summary: Mapping[str, float]) -> StepStats:
        """From ``RouterRecorder.summary``'s figures."""
        compared = "moe/topk_mismatch_share" in summary
        return cls(
            moe=1.0,
            moe_expert_load=summary["moe/expert_load_max_over_mean"],
            moe_router_entropy=summary["moe/router_entropy"],
            moe_compared=float(compared),
            moe_topk_mismatch=summary.get("moe/topk_mismatch_share", 0.0),
            moe_router_disagreement=summary.get("moe/router_disagreement_share", 0.0),
        )

    def counted_once(self, counted: bool) -> StepStats:
        """Zero the sum fields on a rank whose values another rank already counts."""
        if counted:
            return self
        return dataclasses.replace(
            self, **{f.name: 0.0 for f in dataclasses.fields(self) if f.metadata["reduce"] == SUM}
        )


# ---------------------------------------------------------------------------------------- trainer state


@dataclass
class TrainerState:
    """What the step loop carries from step to step and a checkpoint restores (``trainer_state.json``).

    ``to_checkpoint`` gives the JSON object ``save_checkpoint`` writes (it adds ``scheduler`` and ``step``);
    ``from_checkpoint`` reads what ``load_checkpoint`` returns. The on-disk keys are those of earlier
    versions, so old checkpoints resume and new ones read as before.
    """

    step: int = 0  # optimizer-step batches done (rollout batches trained on)
    weight_version: int = 1  # the version the engines serve; 1 = the starting weights
    sampler: dict[str, Any] | None = None  # EpochSampler.state_dict() (the data cursor); None = fresh
    evals: list[Any] = field(default_factory=list)  # each evaluation's summary (None where skipped)
    sdpo_fracs: list[float] = field(default_factory=list)  # route/sdpo_frac of every step
    budget_clock_s: float = 0.0  # seconds the evaluation budget clock had run
    # the next rollout round's number (seeds its sampling); None in checkpoints written before rounds were
    # counted, whose runs dispatched exactly one round per step (so the next is ``step``)
    next_dispatch: int | None = None
    # TeacherWatch.state_dict() (the divergence trend's window); None = fresh, or saved before it existed
    teacher_watch: dict[str, Any] | None = None

    def to_checkpoint(self, sampler: dict[str, Any], budget_clock_s: float) -> dict[str, Any]:
        """The checkpoint's trainer state, with the sampler's and the clock's state at save time."""
        return {
            "weight_version": self.weight_version,
            "sampler": sampler,
            "history": {"evals": self.evals, "sdpo_fracs": self.sdpo_fracs},
            "budget_clock_s": budget_clock_s,
            "next_dispatch": self.next_dispatch,
            "teacher_watch": self.teacher_watch,
        }

    @classmethod
    def from_checkpoint(cls, state: Mapping[str, Any]) -> TrainerState:
        history = state["history"]
        return cls(
            step=state["step"],
            weight_version=state["weight_version"],
            sampler=state["sampler"],
            evals=history["evals"],
            sdpo_fracs=history["sdpo_fracs"],
            budget_clock_s=state.get("budget_clock_s", 0.0),
            next_dispatch=state.get("next_dispatch"),
            teacher_watch=state.get("teacher_watch"),
        )


# -------------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    """A logged metric: its name, how values of it combine (over engines, ranks or steps), its meaning,
    and whether the method (§6) asks for it every step."""

    name: str
    reduce: Reduction
    doc: str
    method: bool = False


def _declare(*metrics: Metric) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for m in metrics:
        if m.name in out:
            raise ValueError(f"metric {m.name!r} is declared twice")
        out[m.name] = m
    return out


_M = Metric
METRICS: dict[str, Metric] = _declare(
    # rank 0's routing of the batch (trainer/collect/sample_routing.route_groups)
    _M("reward/mean", MEAN, "mean reward of the batch's samples", method=True),
    _M("reward/accuracy", MEAN, "share of samples whose reward passes loss.success_threshold", method=True),
    _M("reward/timeouts", SUM, "reward calls that ran past rollout.reward_timeout_s (reward 0)"),
    _M("reward/errors", SUM, "reward calls that raised (reward 0)"),
    _M("route/grpo_frac", MEAN, "share of samples routed to GRPO (correct, not sent to SDPO)", method=True),
    _M("route/sdpo_frac", MEAN, "share of samples routed to SDPO", method=True),
    _M("route/fallback_frac", MEAN, "share of failed samples without a correct sibling", method=True),
    _M("route/has_teacher_frac", MEAN, "share of samples whose group has a correct sibling", method=True),
    _M("route/sdpo_loss_frac", MEAN, "share of samples taking the SDPO loss under loss.mode"),
    _M("samples/routed_to_teacher", SUM, "samples the teacher forward runs on"),
    _M("response/length_mean", MEAN, "mean response length (tokens)", method=True),
    _M("response/length_max", MAX, "longest response (tokens)"),
    _M("response/truncated_frac", MEAN, "share of responses cut at rollout.max_new_tokens"),
    _M("time/generate_s", MAX, "rollout generation, the slowest engine's seconds", method=True),
    _M("time/reward_s", MAX, "reward scoring of the batch on rank 0, seconds", method=True),
    # the engines (trainer/collect/rollout_service.engine_metrics): min/max over engines
    _M("rollout/engines", LAST, "engines that served the step"),
    _M("rollout/samples_per_engine_min", MIN, "fewest samples an engine produced"),
    _M("rollout/samples_per_engine_max", MAX, "most samples an engine produced"),
    _M("rollout/response_tokens_per_engine_min", MIN, "fewest response tokens an engine produced"),
    _M("rollout/response_tokens_per_engine_max", MAX, "most response tokens an engine produced"),
    _M("rollout/engine_seconds_max", MAX, "the slowest engine's generation seconds"),
    _M("rollout/sync_s", LAST, "seconds of the weight sync before this step's rollouts"),
    _M("rollout/aborted", SUM, "generations a weight sync aborted and that were continued (rollout.partial)"),
    _M("engine/restarts", LAST, "engines restarted since the run started"),
    # off-policy rollouts, partial rollouts and dynamic sampling (trainer/collect/off_policy.py)
    _M("async/staleness_mean", MEAN, "trainer version minus each trained sample's version, mean"),
    _M("async/staleness_max", MAX, "trainer version minus the oldest trained sample's version"),
    _M("async/dropped_stale", SUM, "samples dropped this step: staler than rollout.off_policy_steps"),
    _M("async/partial_share", MEAN, "share of trained samples whose tokens span several weight versions"),
    _M("async/engine_idle_share", MEAN, "share of the step's engine-seconds the engines were idle"),
    _M("async/trainer_idle_share", MEAN, "share of the step the trainer waited for rollouts"),
    _M("sampling/rounds", SUM, "rounds of prompts dispatched for this step's batch (dynamic sampling)"),
    _M("sampling/kept_groups", SUM, "groups kept for this step's batch (rollout.dynamic_sampling_criterion)"),
    _M("sampling/dropped_groups", SUM, "groups dynamic sampling set aside (they carry no signal)"),
    _M("sampling/dropped_all_correct", SUM, "set-aside groups whose every member passes the threshold"),
    _M("sampling/dropped_all_wrong", SUM, "set-aside groups whose no member passes the threshold"),
    _M("sampling/dropped_mixed", SUM, "set-aside groups with members on both sides of the threshold"),
    _M("sampling/surplus_groups", SUM, "an earlier step's surplus groups dropped (off_policy_steps 0)"),
    _M("sampling/topped_up", SUM, "dropped groups trained to fill the batch after max_sampling_rounds"),
    # multi-turn rollouts (rollout/multi_turn.multi_turn_metrics), over the batch's trajectories
    _M("multiturn/turns_mean", MEAN, "assistant turns per trajectory, mean"),
    _M("multiturn/turns_max", MAX, "most assistant turns of a trajectory"),
    _M("multiturn/tool_calls", SUM, "tool calls the trajectories made"),
    _M("multiturn/tool_errors", SUM, "tool calls answered with an error (the model's mistakes)"),
    _M("multiturn/tool_raised", SUM, "environment steps that raised (faults, rollout.on_tool_fault)"),
    _M("multiturn/tool_timeouts", SUM, "environment steps past rollout.tool_timeout_s (faults)"),
    _M("multiturn/tool_clipped", SUM, "tool messages clipped to rollout.max_tool_output_tokens"),
    _M("multiturn/truncated_tokens", SUM, "trajectories cut at rollout.max_new_tokens (all turns)"),
    _M("multiturn/truncated_turns", SUM, "trajectories cut at rollout.max_turns"),
    _M("multiturn/failed", SUM, "trajectories a fault ended under on_tool_fault=fail (reward 0)"),
    _M("multiturn/env_reward_mean", MEAN, "the environment's per-turn reward parts, summed per trajectory"),
    _M("multiturn/tool_token_frac", MEAN, "share of response tokens that are tool/user turns (mask 0)"),
    # the scoring and learning passes, reduced over ranks (trainer/observe/step_metrics.step_metrics)
    _M("loss/total", SUM, "the objective L, summed over mini-batches", method=True),
    _M("loss/grpo", MEAN, "GRPO loss per response token", method=True),
    _M("loss/sdpo", MEAN, "SDPO loss per response token", method=True),
    _M("loss/grpo_clip_frac", MEAN, "share of GRPO tokens whose ratio was clipped"),
    _M("tokens/grpo_frac", MEAN, "share of response tokens under the GRPO loss"),
    _M("tokens/sdpo_frac", MEAN, "share of response tokens under the SDPO loss"),
    _M("tokens/total", SUM, "response tokens trained on"),
    _M("teacher/entropy_mean", MEAN, "teacher entropy per SDPO token", method=True),
    _M("teacher/divergence_mean", MEAN, "top-K divergence per SDPO token"),
    _M("teacher/divergence_trend", LAST, "slope of teacher/divergence_mean per step, last SDPO steps"),
    _M("samples/teacher_forward", SUM, "samples the teacher forward scored"),
    _M("dw/w_tilde_mean", MEAN, "mean entropy weight w̃ over SDPO tokens", method=True),
    _M("dw/w_tilde_std", MEAN, "spread of w̃ over SDPO tokens", method=True),
    _M("grad_norm", MEAN, "gradient norm, mean over the step's optimizer steps", method=True),
    _M("train/skipped_steps", MAX, "1 if an optimizer step was skipped (non-finite)"),
    _M("train/lr", LAST, "learning rate of the step"),
    _M("logprob/gap_mean", MEAN, "mean |log π_old − log π_rollout| per token", method=True),
    _M("logprob/gap_max", MAX, "max |log π_old − log π_rollout|", method=True),
    _M("logprob/topk_kl_mean", MEAN, "KL(engine‖trainer) over the engine's top-K ids + tail, per token"),
    _M("logprob/topk_kl_max", MAX, "max per-token KL(engine‖trainer) over the engine's top-K ids + tail"),
    # the CPU engine's precision audit (rollout/precision_audit.py): served vs sent weights, same arithmetic
    _M("logprob/precision_gap_mean", MEAN, "mean |log π_served − log π_sent| per token, in the engine"),
    _M("logprob/precision_gap_max", MAX, "max |log π_served − log π_sent|: 0 exactly when served = sent"),
    _M("loss/is_masked_frac", MEAN, "share of response tokens the IS correction gave no loss (mis, icepop)"),
    _M("loss/stale_masked_frac", MEAN, "share of response tokens dropped as stale (loss.mask_stale_tokens)"),
    _M("time/score_s", MAX, "scoring pass (student), the slowest rank's seconds", method=True),
    _M("time/teacher_s", MAX, "teacher scoring, the slowest rank's seconds", method=True),
    _M("time/train_s", MAX, "training pass, the slowest rank's seconds", method=True),
    _M("time/weight_sync_s", MAX, "weight sync after the step, seconds", method=True),
    _M("time/step_s", MAX, "the whole step, seconds"),
    _M("perf/tokens_per_s", MEAN, "response tokens trained per second of the step", method=True),
    # MoE policies (models/moe_metrics.py, via StepStats.from_moe)
    _M("moe/expert_load_max_over_mean", MAX, "worst layer's max/mean tokens per expert"),
    _M("moe/router_entropy", MEAN, "mean per-token router entropy (nats)"),
    _M("moe/topk_mismatch_share", MEAN, "share of (token, layer) whose used top-k != the engine's"),
    _M("moe/router_disagreement_share", MEAN, "same for the trainer's own top-k (before replay)"),
    # parallel.offload_during_rollout (trainer/state/offload.py)
    _M("memory/rollout_resident_bytes", LAST, "trainer bytes left on the device during rollouts"),
    *(
        _M(f"memory/rollout_resident/{part}", LAST, f"{part} bytes left on the device during rollouts")
        for part in ("policy_params", "gradient_buffers", "optimizer", "teacher_bf16", "teacher_fp32")
    ),  # offload.METRIC_NAMES
    _M("memory/teacher_fp32_ema_bytes", LAST, "bytes of the teacher's fp32 EMA copy on this rank"),
    _M("memory/rollout_allocated_bytes", LAST, "accelerator bytes allocated during rollouts"),
)

METHOD_METRICS: tuple[str, ...] = tuple(m.name for m in METRICS.values() if m.method)

# Metrics with one name per benchmark (``data.rows.Row.benchmark``, e.g. ``sciknoweval/physics``): the
# ``{benchmark}`` part is any non-empty name; declared once here, like the fixed names above.
METRIC_FAMILIES: tuple[Metric, ...] = (
    _M("reward/{benchmark}/mean", MEAN, "mean reward of the batch's samples of one benchmark (multi-domain)"),
    _M("reward/{benchmark}/accuracy", MEAN, "share of one benchmark's samples that pass (multi-domain)"),
)


def benchmark_metric(template: str, benchmark: str) -> str:
    """The name of a :data:`METRIC_FAMILIES` metric for ``benchmark``."""
    return template.replace("{benchmark}", benchmark)


def declared(name: str) -> Metric | None:
    """The declaration of ``name``: in :data:`METRICS`, or the :data:`METRIC_FAMILIES` entry it fills."""
    if name in METRICS:
        return METRICS[name]
    for m in METRIC_FAMILIES:
        head, tail = m.name.split("{benchmark}")
        if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
            return m
    return None


def undeclared(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that :data:`METRICS` (or :data:`METRIC_FAMILIES`) does not declare."""
    return sorted(n for n in names if declared(n) is None)


def merge_metrics(*parts: Mapping[str, float]) -> dict[str, float]:
    """One step's metrics from its parts; a name produced by two parts is an error (one name, one
    meaning), and so is a name :data:`METRICS` does not declare."""
    out: dict[str, float] = {}
    for part in parts:
        twice = sorted(set(out) & set(part))
        if twice:
            raise KeyError(
                f"metrics {twice} are produced twice in one step; each name has one meaning: rename one "
                "of them and declare it in trainer/step_types.METRICS"
            )
        out.update(part)
    unknown = undeclared(out)
    if unknown:
        raise KeyError(f"metrics {unknown} are not declared; declare them in trainer/step_types.METRICS")
    return out
