"""method §1 steps 2–4 on rank 0: rewards of completed groups, then routing, advantages and the teacher's
context of the groups a step trains, as one ``RolloutBatch``.

Two phases, because dynamic sampling needs a group's rewards before the step's batch exists
(``trainer/collect/sample_pool.py``):

- ``reward_groups``: decode and reward completed groups (one ``RewardPool`` call);
- ``route_groups``: route the groups a step trains, each group on its own rewards (routing, advantages and
  the sibling are per group: a group routes the same whatever batch it lands in, and whatever weight
  versions its samples came from), every ``Sample`` built once, frozen, in group then member order.

The trainer runs them through ``trainer/collect/sample_pool.py``: ``SamplePool.add`` checks each group's
size (``check_group_sizes``, the one place of that rule) and calls ``reward_groups``; ``SamplePool.take``
calls ``route_groups`` on the groups a step trains.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from srpo_megatron.config import LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.losses import group_advantages, route, routing_masks
from srpo_megatron.rewards.pool import RewardPool, RewardResult
from srpo_megatron.rollout.base import Completion, SamplingParams
from srpo_megatron.rollout.multi_turn import Trajectory, multi_turn_metrics
from srpo_megatron.rollout.routed_experts import compact_ids
from srpo_megatron.trainer.step_types import RolloutBatch, Sample, benchmark_metric, merge_metrics

# SDPO's rule (verl ray_trainer ``_remove_thinking_trace``): each think block and the whitespace after it
# go; nothing else is stripped, so leading and trailing whitespace of the response stays.
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
# the chat template's control tokens (ChatML ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...)
_CONTROL = re.compile(r"<\|[^|<>\s]+\|>")


def clean_solution(text: str) -> str:
    """The sibling's decoded response as the teacher sees it: each ``<think>…</think>`` block and the
    whitespace following it removed, everything else verbatim (as SDPO's code; no ``strip``)."""
    return _THINK.sub("", text)


def trajectory_messages(
    tokenizer: Any, token_ids: list[int], response_mask: list[int]
) -> list[dict[str, str]]:
    """A multi-turn response as chat messages: ``token_ids`` split into runs of equal ``response_mask``
    (1 = an assistant turn's engine tokens, 0 = the tool/user turn the chat template rendered between two
    assistant turns), each run decoded and cleaned by SDPO's rule (``clean_solution``: each assistant
    turn's think blocks go, and the template's empty ones between turns), then the chat template's
    control tokens (``<|…|>``, e.g. ``<|im_start|>``, ``<|im_end|>``) removed. Decoded with the special
    tokens kept first: a tokenizer that marks ``<think>`` / ``<tool_call>`` special (the packaged Qwen3
    one) would otherwise drop the think tags and leave the reasoning in. Roles ``assistant`` and ``tool``;
    the contents concatenate to the text the teacher is shown.
    """
    if len(token_ids) != len(response_mask):
        raise ValueError(
            f"a response of {len(token_ids)} tokens has a response_mask of {len(response_mask)} entries; "
            "the rollout must give one entry per response token"
        )
    messages: list[dict[str, str]] = []
    start = 0
    for t in range(1, len(token_ids) + 1):
        if t == len(token_ids) or response_mask[t] != response_mask[start]:
            text = clean_solution(tokenizer.decode(token_ids[start:t], skip_special_tokens=False))
            role = "assistant" if response_mask[start] == 1 else "tool"
            messages.append({"role": role, "content": _CONTROL.sub("", text)})
            start = t
    return messages


def solution_text(tokenizer: Any, completion: Completion, decoded: str) -> str:
    """The correct sibling's response as the teacher sees it (``{sibling_response}``): single-turn
    (``response_mask`` None), its decoded text cleaned, as SDPO; multi-turn, its whole trajectory (assistant
    turns and tool results, ``trajectory_messages``), every turn cleaned on its own."""
    mask = completion_mask(completion)
    if mask is None:
        return clean_solution(decoded)
    return "".join(m["content"] for m in trajectory_messages(tokenizer, completion.token_ids, mask))


def completion_mask(completion: Completion) -> list[int] | None:
    """The rollout's per-token assistant mask of a completion (the multi-turn rollout's ``Trajectory`` in
    ``Completion.meta``; None = single-turn)."""
    traj = Trajectory.of(completion)
    return None if traj is None else list(traj.response_mask)


def teacher_prompt_ids(
    tokenizer: Any, prompt: Prompt, sibling_text: str, cfg: TeacherConfig, *, clean: bool = True
) -> list[int]:
    """method §1.4: system kept, the user turn shows the correct sibling's solution (``sibling_text``,
    cleaned here by ``clean_solution`` unless ``clean`` is False: ``solution_text`` cleaned it per turn);
    the chat template gets ``teacher.enable_thinking``; right-truncated to ``teacher.max_prompt_tokens``."""
    shown = clean_solution(sibling_text) if clean else sibling_text
    user = cfg.solution_template.format(user_prompt=prompt.row.prompt, sibling_response=shown)
    text = template_text(tokenizer, user, prompt.row.system, enable_thinking=cfg.enable_thinking)
    return encode_text(tokenizer, text)[: cfg.max_prompt_tokens]


def sampling_params(rollout: RolloutConfig, seed: int, prompt_offset: int = 0) -> SamplingParams:
    """G samples per prompt; per-sample seeds follow the global prompt index (``prompt_offset`` + i)."""
    return SamplingParams(
        n=rollout.group_size,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        seed=seed,
        prompt_offset=prompt_offset,
        # The CPU engine reports experts for free (the mismatch metric); SGLang only when replaying, since
        # its server must run with --enable-return-routed-experts.
        return_routed_experts=rollout.routing_replay or rollout.engine == "hf",
        top_logprobs=rollout.parity_top_k,
    )


def check_group_sizes(sizes: list[int], group_size: int) -> None:
    """Refuse groups that do not hold exactly ``rollout.group_size`` completions (``sizes``: per group)."""
    if any(s != group_size for s in sizes):
        got = f"got sizes {sizes}"
        raise ValueError(f"every group needs rollout.group_size = {group_size} completions; {got}")


@dataclass
class Scores:
    """``reward_groups``' answer: per group, each member's decoded response and reward.

    texts, rewards: ``[groups][members]``; result: the pool's counters (``reward/timeouts``,
    ``reward/errors``); seconds: the scoring's wall time (the step's ``time/reward_s``).
    """

    texts: list[list[str]]
    rewards: list[list[float]]
    result: RewardResult
    seconds: float


def reward_groups(
    tokenizer: Any, prompts: list[Prompt], completions: list[list[Completion]], rewards: RewardPool
) -> Scores:
    """Rank 0: decode and reward ``completions[group][member]`` against ``prompts[group]`` (one pool call)."""
    rows = [(i, c) for i, (_, group) in enumerate(zip(prompts, completions, strict=True)) for c in group]
    texts = [_response_text(tokenizer, c) for _, c in rows]
    t1 = time.monotonic()
    scored = rewards.score(
        [prompts[i].row.kind for i, _ in rows], texts, [prompts[i].row.answer for i, _ in rows]
    )
    seconds = time.monotonic() - t1
    values = [trajectory_reward(float(v), c) for v, (_, c) in zip(scored.rewards, rows, strict=True)]
    text_groups: list[list[str]] = []
    member_rewards: list[list[float]] = []
    k = 0
    for group in completions:
        text_groups.append(texts[k : k + len(group)])
        member_rewards.append(values[k : k + len(group)])
        k += len(group)
    return Scores(text_groups, member_rewards, scored, seconds)


def _response_text(tokenizer: Any, c: Completion) -> str:
    """What the verifier reads: the response decoded, or a multi-turn trajectory's assistant turns (the
    tool/user turns between them are the environment's words, not the model's)."""
    traj = Trajectory.of(c)
    if traj is not None:
        return traj.assistant_text
    return tokenizer.decode(c.token_ids, skip_special_tokens=True)


def trajectory_reward(verifier: float, c: Completion) -> float:
    """A multi-turn trajectory's reward: the verifier's plus the environment's per-turn parts, or 0 when a
    fault ended it under ``rollout.on_tool_fault: fail``; a single-turn sample's is the verifier's."""
    traj = Trajectory.of(c)
    if traj is None:
        return verifier
    return 0.0 if traj.failed else verifier + float(sum(traj.turn_rewards))


def route_groups(
    tokenizer: Any,
    prompts: list[Prompt],
    completions: list[list[Completion]],
    texts: list[list[str]],
    rewards: list[list[float]],
    loss: LossConfig,
    teacher: TeacherConfig,
    uids: list[list[str]] | None = None,
) -> RolloutBatch:
    """Rank 0: routing, advantages and teacher prompts of scored groups; each ``Sample`` built once with
    all its fields (``uid`` from ``uids[group][member]``, ``weight_version`` and ``token_versions`` from its
    ``Completion``), in group then member order. Metrics: ``reward/*``, ``route/*``, ``samples/*``,
    ``response/*`` over the batch (no times, no reward-pool counters: the caller adds those).

    Every group needs the same number of members (rewards form ``[B, G]``); each row is routed on its own
    (``losses.route`` and ``group_advantages`` work row by row).
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    if r.dim() != 2 or r.shape[0] != len(prompts):
        raise ValueError(
            f"route_groups needs [groups][members] rewards with one row per prompt and equal group sizes; "
            f"got {len(prompts)} prompts and rewards of shape {tuple(r.shape)}"
        )
    routing = route(r, loss.success_threshold)
    grpo, sdpo, needs_teacher = routing_masks(routing, loss.mode)
    adv = group_advantages(r, loss.std_normalize, loss.std_eps)
    samples: list[Sample] = []
    for i, (prompt, group) in enumerate(zip(prompts, completions, strict=True)):
        for j, c in enumerate(group):
            context = None
            if needs_teacher[i, j]:
                sib = int(routing.sibling[i, j])
                shown = solution_text(tokenizer, group[sib], texts[i][sib])
                context = teacher_prompt_ids(tokenizer, prompt, shown, teacher, clean=False)
            samples.append(
                Sample(
                    i,
                    j,
                    list(prompt.ids),
                    list(c.token_ids),
                    list(c.logprobs),
                    reward=float(r[i, j]),
                    advantage=float(adv[i, j]),
                    grpo=bool(grpo[i, j]),
                    sdpo=bool(sdpo[i, j]),
                    needs_teacher=bool(needs_teacher[i, j]),
                    teacher_prompt_ids=context,
                    finish_reason=c.finish_reason,
                    response_mask=completion_mask(c),
                    routed_experts=None if c.routed_experts is None else compact_ids(c.routed_experts),
                    uid="" if uids is None else uids[i][j],
                    weight_version=c.weight_version,
                    token_versions=None if c.token_versions is None else list(c.token_versions),
                    engine_top_ids=c.top_ids,
                    engine_top_logp=c.top_logprobs,
                )
            )
    n = len(samples)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    fallback = (~routing.correct & ~routing.has_teacher).double().mean().item()
    metrics = {
        "reward/mean": r.mean().item(),
        "reward/accuracy": routing.correct.double().mean().item(),
        "route/grpo_frac": (~routing.to_sdpo & routing.correct).double().mean().item(),
        "route/sdpo_frac": routing.to_sdpo.double().mean().item(),
        "route/fallback_frac": fallback,
        "route/has_teacher_frac": routing.has_teacher.double().mean().item(),
        # samples that take the SDPO loss under the mode (= sdpo_frac in srpo; differs in the SDPO modes)
        "route/sdpo_loss_frac": sdpo.double().mean().item(),
        "samples/routed_to_teacher": float(sum(s.needs_teacher for s in samples)),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
    }
    metrics.update(precision_gap_metrics([c for group in completions for c in group]))
    benchmarks = [p.row.benchmark for p in prompts]
    turns = multi_turn_metrics([c for g in completions for c in g])
    return RolloutBatch(samples, merge_metrics(metrics, per_benchmark(benchmarks, r, routing.correct), turns))


def precision_gap_metrics(completions: list) -> dict[str, float]:
    """``logprob/precision_gap_mean`` / ``_max`` over the response tokens of the completions the engine
    audited (``Completion.precision_gap``, ``rollout/precision_audit.py``); {} when none was."""
    gaps = [g for c in completions if c.precision_gap is not None for g in c.precision_gap]
    if not any(c.precision_gap is not None for c in completions):
        return {}
    gap = torch.tensor(gaps, dtype=torch.float64)
    if not gap.numel():
        return {"logprob/precision_gap_mean": 0.0, "logprob/precision_gap_max": 0.0}
    return {"logprob/precision_gap_mean": gap.mean().item(), "logprob/precision_gap_max": gap.max().item()}


def per_benchmark(benchmarks: list[str], rewards: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """``reward/<benchmark>/mean`` and ``/accuracy`` over each benchmark's groups, when the batch holds
    more than one benchmark (a multi-domain run; a one-benchmark batch has only ``reward/mean``).

    benchmarks: one per group; rewards, correct: ``[groups, members]``. Benchmarks come from the data file
    of each prompt (``data.rows.benchmark_name``).
    """
    names = sorted(set(benchmarks))
    if len(names) < 2:
        return {}
    out: dict[str, float] = {}
    for b in names:
        rows = torch.tensor([x == b for x in benchmarks], dtype=torch.bool)
        out[benchmark_metric("reward/{benchmark}/mean", b)] = rewards[rows].mean().item()
        out[benchmark_metric("reward/{benchmark}/accuracy", b)] = correct[rows].double().mean().item()
    return out
