"""method §1 steps 1–4: rollouts, rewards, routing and the teacher's context, as one ``RolloutBatch``.

Runs on the rank that hosts the rollout engine (global rank 0); the result is plain Python data that
``broadcast_batch`` ships to every trainer rank, so all ranks agree on routing and advantages.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.losses import group_advantages, route, routing_masks
from srpo_megatron.losses.config import LossConfig
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import EngineError, RolloutEngine, SamplingParams
from srpo_megatron.rollout.routed_experts import compact_ids
from srpo_megatron.trainer.config import RolloutConfig, TeacherConfig

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclass
class Sample:
    """One rollout y_i of prompt group ``group`` (index ``member`` in the group)."""

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
    # MoE: the engine's experts per forwarded position, [P + R - 1, layers, top_k] (or flat), small int
    # dtype; None when the engine reported none. Replayed by the policy (trainer/moe_routing.py).
    routed_experts: torch.Tensor | None = None


@dataclass
class RolloutBatch:
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


def clean_solution(text: str) -> str:
    """The sibling's response as the teacher sees it: ``<think>…</think>`` blocks removed."""
    return _THINK.sub("", text).strip()


def teacher_prompt_ids(tokenizer: Any, prompt: Prompt, sibling_text: str, cfg: TeacherConfig) -> list[int]:
    """method §1.4: system kept, the user turn shows the correct sibling's solution; right-truncated."""
    user = cfg.solution_template.format(
        user_prompt=prompt.row.prompt, sibling_response=clean_solution(sibling_text)
    )
    ids = encode_text(tokenizer, template_text(tokenizer, user, prompt.row.system, enable_thinking=False))
    return ids[: cfg.max_prompt_tokens]


def collect_rollouts(
    engine: RolloutEngine,
    tokenizer: Any,
    prompts: list[Prompt],
    rollout: RolloutConfig,
    loss: LossConfig,
    teacher: TeacherConfig,
    rewards: RewardPool,
    seed: int,
) -> RolloutBatch:
    """Generate G rollouts per prompt, score, route and build teacher prompts (method §1 steps 1–4)."""
    t0 = time.monotonic()
    params = SamplingParams(
        n=rollout.group_size,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        seed=seed,
        # The CPU engine reports experts for free (the mismatch metric); SGLang only when replaying, since
        # its server must run with --enable-return-routed-experts.
        return_routed_experts=rollout.routing_replay or rollout.engine == "hf",
    )
    completions = engine.generate([list(p.ids) for p in prompts], params)
    t_gen = time.monotonic() - t0
    samples: list[Sample] = []
    texts: list[str] = []
    for g, (prompt, group) in enumerate(zip(prompts, completions, strict=True)):
        for m, c in enumerate(group):
            samples.append(Sample(g, m, list(prompt.ids), list(c.token_ids), list(c.logprobs)))
            samples[-1].finish_reason = c.finish_reason
            if c.meta.get("routed_experts") is not None:
                samples[-1].routed_experts = compact_ids(c.meta["routed_experts"])
            texts.append(tokenizer.decode(c.token_ids, skip_special_tokens=True))
    t1 = time.monotonic()
    scored = rewards.score(
        [prompts[s.group].row.kind for s in samples], texts, [prompts[s.group].row.answer for s in samples]
    )
    t_reward = time.monotonic() - t1
    b, g = len(prompts), rollout.group_size
    r = torch.tensor(scored.rewards, dtype=torch.float64).view(b, g)
    routing = route(r, loss.success_threshold)
    grpo, sdpo, needs_teacher = routing_masks(routing, loss.mode)
    adv = group_advantages(r, loss.std_normalize, loss.std_eps)
    for s in samples:
        i, j = s.group, s.member
        s.reward, s.advantage = float(r[i, j]), float(adv[i, j])
        s.grpo, s.sdpo, s.needs_teacher = bool(grpo[i, j]), bool(sdpo[i, j]), bool(needs_teacher[i, j])
        if s.needs_teacher:
            sib = int(routing.sibling[i, j])
            s.teacher_prompt_ids = teacher_prompt_ids(tokenizer, prompts[i], texts[i * g + sib], teacher)
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
        "time/generate_s": t_gen,
        "time/reward_s": t_reward,
        **scored.metrics(),
    }
    return RolloutBatch(samples, metrics)


def broadcast_batch(batch: Any, src: int = 0, group: Any = None) -> Any:
    """Ship the batch (a host object) from ``src`` to every rank over the gloo ``group`` (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert batch is not None
        return batch
    box = [batch]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class RolloutService:
    """The rollout side of the SPMD job: engine + reward pool on global rank 0, collectives everywhere.

    ``collect`` returns the same routed batch on every rank. If the engine fails (crash, timeout, refused
    update) rank 0 reports it with the step, every rank joins a restart: a fresh engine is built and the
    current policy weights are synced into it, then the step's rollouts are retried once.
    """

    def __init__(self, cfg: Any, tokenizer: Any, runtime: Any, groups: Any) -> None:
        from srpo_megatron.rollout.factory import build_engine

        self.cfg, self.tokenizer, self.runtime, self.groups = cfg, tokenizer, runtime, groups
        self.rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self._build = lambda: build_engine(cfg.rollout, cfg.model)
        self.engine = self._build() if self.rank0 else None
        r = cfg.rollout
        self.rewards = (
            RewardPool(r.reward_workers, r.reward_timeout_s, import_timeout_s=r.reward_import_timeout_s)
            if self.rank0
            else None
        )
        self.version = 0
        self.restarts = 0

    def sync(self, version: int) -> float:
        """Collective: install the policy into the engine as ``version``; returns seconds taken."""
        from srpo_megatron.weights.sync import sync_in_process

        t0 = time.monotonic()
        if self.rank0 and self.cfg.rollout.placement == "colocated":
            self.engine.resume_memory()
        sync_in_process(self.runtime.model, self.runtime.table, self.groups, self.engine, version)
        self.version = version
        return time.monotonic() - t0

    def _try_collect(self, prompts: list[Prompt], step: int) -> RolloutBatch | str:
        c = self.cfg
        try:
            batch = collect_rollouts(
                self.engine,
                self.tokenizer,
                prompts,
                c.rollout,
                c.loss,
                c.teacher,
                self.rewards,
                seed=c.run.seed * 1_000_003 + step,
            )
        except EngineError as e:
            return f"rollout engine failed at step {step + 1} (weights v{self.version}): {e}"
        if c.rollout.placement == "colocated":
            self.engine.release_memory()  # give the accelerator memory to training
        return batch

    def collect(self, prompts: list[Prompt], step: int) -> RolloutBatch:
        """Collective: rollouts, rewards and routing for ``prompts`` (method §1 steps 1–4)."""
        result = broadcast_batch(
            self._try_collect(prompts, step) if self.rank0 else None, group=self.groups.host
        )
        if isinstance(result, RolloutBatch):
            return result
        print(f"[srpo] {result}; restarting the engine and resyncing", flush=True)
        if self.rank0:
            with contextlib.suppress(Exception):  # the engine is already broken
                self.engine.shutdown()
            self.engine = self._build()
        self.restarts += 1
        self.sync(self.version)
        result = broadcast_batch(
            self._try_collect(prompts, step) if self.rank0 else None, group=self.groups.host
        )
        if not isinstance(result, RolloutBatch):
            raise EngineError(f"{result} (again after a restart; giving up)")
        return result

    def close(self) -> None:
        if self.rank0:
            self.rewards.close()
            self.engine.shutdown()
