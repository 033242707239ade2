"""Rank 0's pool of completed, rewarded prompt groups, from "groups arrive" to "a step's batch is routed".

The scheduler (``trainer/collect/off_policy.py``) dispatches prompts to the engines and hands every completed
group to ``SamplePool.add``; ``SamplePool.take`` answers a routed ``RolloutBatch`` of exactly ``n`` groups,
or None while it needs more (``missing`` says how many prompts the next round should draw). Pure host
bookkeeping: no collectives, nothing but rank 0 calls it. The rules:

- **Rewards on arrival.** ``add`` rewards each group at once (one ``RewardPool`` call per ``add``):
  dynamic sampling decides on them, and a group routes on its own rewards wherever it is trained.
- **Dynamic sampling** (``rollout.dynamic_sampling``, after DAPO, Yu et al. 2025, §3.2). ``add`` keeps the
  groups that carry signal and sets the others aside (``sampling/kept_groups``, ``sampling/dropped_groups``,
  and by what the set-aside group is: ``sampling/dropped_all_correct``, ``_all_wrong``, ``_mixed``, judged
  by ``loss.success_threshold``). Without dynamic sampling every group is kept. Which groups carry signal
  is ``rollout.dynamic_sampling_criterion`` (``CompletedGroup.carries_signal``): ``mixed`` (some members
  pass the threshold, some do not), ``std`` (DAPO's: the group's reward std > ε,
  ``rollout.dynamic_sampling_std_eps``), or ``auto`` (default): exactly the groups that give ``loss.mode``'s
  loss a nonzero term: GRPO's advantage is nonzero iff the rewards spread (std > ε), and an SDPO sample
  needs a correct sibling. So ``grpo`` keeps std > ε; ``srpo``/``srpo_no_dw`` mixed or std > ε (with 0/1
  rewards: mixed); ``sdpo`` every group with a correct member (an all-correct group distils each member
  toward a correct sibling); ``sdpo_incorrect_only`` mixed; ``sdpo_correct_only`` two or more correct;
  ``advantage_mix`` std > ε (λ > 0) or a correct member (λ < 1).
- **Rounds.** ``missing(n, in_flight)`` is how many prompts the next round should dispatch: ``n`` minus
  the kept groups and the prompts still in flight; a nonzero answer counts one round of the step
  (``sampling/rounds``). After ``rollout.max_sampling_rounds`` rounds the set-aside groups count too: the
  batch is topped up with the most recently set-aside groups so it keeps its shape
  (``sampling/topped_up``); only if those do not suffice either is another round drawn.
- **Oldest first, surplus carried.** ``take`` trains the oldest kept groups by (dispatch, index in the
  dispatch); kept groups beyond ``n`` stay for the next step (the staleness rule then decides). The
  set-aside groups are forgotten when a batch is taken (they belonged to that step's rounds).
- **Staleness** (``rollout.off_policy_steps``: the ``bound``). A sample is stale when
  ``trainer_version − version > bound``, its version being its NEWEST token's (``max(token_versions)``
  for a partial rollout, else the dispatch ``weight_version``); its older tokens are the loss's business
  (importance corrections). ``take`` drops every group with a stale member before choosing, and counts
  its samples in ``async/dropped_stale``: nothing stale is trained silently. Stale set-aside groups are
  never used for a top-up (already counted as dropped groups, not again as stale). At ``bound`` 0
  (on-policy) nothing is generated ahead of its step, so a group that turns stale is dynamic sampling's
  surplus from an earlier step (a round answers more groups than the batch needs): it is dropped the
  same way but counted as ``sampling/surplus_groups`` (groups), not in ``async/dropped_stale``.
- **The step's metrics** (``take``): the routing metrics of ``sample_routing.route_groups`` over the trained
  groups; ``time/reward_s``, ``reward/timeouts``, ``reward/errors`` of every ``add`` since the last batch;
  ``sampling/*``; ``async/dropped_stale``; ``async/staleness_mean``/``_max`` (trainer version minus each
  trained sample's dispatch ``weight_version``, i.e. its oldest token's); ``async/partial_share`` (share
  of trained samples whose tokens span more than one version).
- **Loud reward failures** (``trainer/collect/reward_errors.py``): when ``take`` answers a batch, more than
half
  of the rewards scored since the last batch failed: a warning with the first messages; all of them: the
  run stops (``RewardsFailed``) unless ``rollout.allow_reward_errors``.
- **Checkpoints.** ``state_dict`` holds every group not yet trained and the step's counters as plain
  python and tensors (``torch.save``-able); ``load_state_dict`` restores them exactly, so a resumed run
  trains them.

Each trained ``Sample`` carries ``uid = f"{dispatch}/{index}/{member}"`` (run-unique as long as dispatch
ids are), its ``weight_version`` and ``token_versions`` from its ``Completion``.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from srpo_megatron.config import LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import Completion
from srpo_megatron.trainer.collect.reward_errors import check_step_rewards
from srpo_megatron.trainer.collect.sample_routing import check_group_sizes, reward_groups, route_groups
from srpo_megatron.trainer.step_types import RolloutBatch, merge_metrics

STATE_FORMAT = 1  # bump when state_dict's layout changes


@dataclass
class CompletedGroup:
    """One prompt's ``G`` completions as the engines returned them; rewarded by ``SamplePool.add``.

    ``dispatch`` (the scheduler's id of the dispatch that drew the prompt) and ``index`` (the prompt's
    position in it) identify the group in the run; ``round`` is the scheduler's label of the sampling
    round (logged, the pool counts rounds itself); ``dataset_index`` where the prompt came from (None when
    unknown). ``texts`` and ``rewards`` are ``[G]``, set by ``add``.
    """

    prompt: Prompt
    completions: list[Completion]
    dispatch: int
    index: int
    round: int = 0
    dataset_index: int | None = None
    texts: list[str] | None = None
    rewards: list[float] | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Age order: older dispatches first, then prompt order within a dispatch."""
        return (self.dispatch, self.index)

    def mixed(self, threshold: float) -> bool:
        """Some members pass ``threshold`` and some do not (SRPO's signal: GRPO advantage and a sibling)."""
        assert self.rewards is not None, "a group is rewarded by SamplePool.add before it is judged"
        correct = [r >= threshold for r in self.rewards]
        return any(correct) and not all(correct)

    def spread(self, eps: float) -> bool:
        """The rewards' sample standard deviation exceeds ``eps`` (DAPO's criterion; GRPO's advantage is
        nonzero somewhere exactly when the rewards are not all equal)."""
        assert self.rewards is not None, "a group is rewarded by SamplePool.add before it is judged"
        return statistics.stdev(self.rewards) > eps

    def carries_signal(self, criterion: str, loss: LossConfig, eps: float) -> bool:
        """Whether dynamic sampling keeps the group (``rollout.dynamic_sampling_criterion``; the rule per
        ``loss.mode`` for ``auto`` is in the module docstring)."""
        assert self.rewards is not None, "a group is rewarded by SamplePool.add before it is judged"
        t = loss.success_threshold
        if criterion == "mixed":
            return self.mixed(t)
        if criterion == "std":
            return self.spread(eps)
        correct = sum(r >= t for r in self.rewards)
        mode = loss.mode
        if mode == "grpo":
            return self.spread(eps)
        if mode in ("srpo", "srpo_no_dw"):
            return self.mixed(t) or self.spread(eps)
        if mode == "sdpo":
            return correct >= 1  # every other member has that correct sibling
        if mode == "sdpo_incorrect_only":
            return self.mixed(t)
        if mode == "sdpo_correct_only":
            return correct >= 2  # a correct member's teacher needs another correct one
        if mode == "advantage_mix":
            lam = loss.adv_mix_lambda
            return (lam > 0 and self.spread(eps)) or (lam < 1 and correct >= 1)
        raise ValueError(f"no dynamic-sampling rule for loss.mode={mode!r}")

    def composition(self, threshold: float) -> str:
        """``all_correct``, ``all_wrong`` or ``mixed`` by ``threshold`` (the set-aside counters' reason)."""
        assert self.rewards is not None, "a group is rewarded by SamplePool.add before it is judged"
        correct = [r >= threshold for r in self.rewards]
        return "all_correct" if all(correct) else "mixed" if any(correct) else "all_wrong"

    def newest_versions(self) -> list[int]:
        """Each member's newest token's weight version (the one staleness is measured by)."""
        return [max(c.token_versions) if c.token_versions else c.weight_version for c in self.completions]


def groups_of(
    dispatch: int,
    prompts: list[Prompt],
    completions: list[list[Completion]],
    round: int = 0,
    dataset_indices: list[int] | None = None,
) -> list[CompletedGroup]:
    """A dispatched round's completed groups: ``completions[i]`` answers ``prompts[i]``, index ``i``."""
    where: list[int | None] = list(dataset_indices) if dataset_indices else [None] * len(prompts)
    return [
        CompletedGroup(p, g, dispatch, i, round, k)
        for i, (p, g, k) in enumerate(zip(prompts, completions, where, strict=True))
    ]


@dataclass
class _StepCounters:
    """What the pool counted since the last batch it answered (the next batch's metrics)."""

    rounds: int = 0
    kept: int = 0
    dropped: int = 0
    dropped_stale: int = 0
    dropped_all_correct: int = 0  # set-aside groups by composition (they sum to ``dropped``)
    dropped_all_wrong: int = 0
    dropped_mixed: int = 0
    surplus: int = 0  # stale groups at bound 0: an earlier step's surplus (groups)
    reward_s: float = 0.0
    reward_timeouts: int = 0
    reward_errors: int = 0
    rewards_scored: int = 0
    reward_messages: list[str] = field(default_factory=list)  # the first few failures' messages


@dataclass
class SamplePool:
    """Completed groups on rank 0 between the engines and the step's batch (rules: module docstring).

    tokenizer decodes responses and builds teacher prompts; rewards is rank 0's ``RewardPool``.
    """

    tokenizer: Any
    rollout: RolloutConfig
    loss: LossConfig
    teacher: TeacherConfig
    rewards: RewardPool
    kept: list[CompletedGroup] = field(default_factory=list)  # carrying signal (all without dynamic sampling)
    set_aside: list[CompletedGroup] = field(default_factory=list)  # carrying none, in arrival order
    counters: _StepCounters = field(default_factory=_StepCounters)

    def __len__(self) -> int:
        """Groups that may be trained (kept; before ``take`` drops the stale ones)."""
        return len(self.kept)

    # ------------------------------------------------------------------------------------------ arrive

    def add(self, groups: list[CompletedGroup]) -> None:
        """Reward ``groups`` (one pool call) and keep them, or, with dynamic sampling, keep the ones that
        carry signal and set the others aside for a possible top-up."""
        if not groups:
            return
        check_group_sizes([len(x.completions) for x in groups], self.rollout.group_size)
        t0 = time.monotonic()
        scores = reward_groups(
            self.tokenizer, [x.prompt for x in groups], [x.completions for x in groups], self.rewards
        )
        c = self.counters
        c.reward_s += time.monotonic() - t0
        c.reward_timeouts += scores.result.num_timeouts
        c.reward_errors += scores.result.num_errors
        c.rewards_scored += len(scores.result.rewards)
        c.reward_messages = (c.reward_messages + scores.result.errors)[:10]
        r = self.rollout
        for x, texts, rewards in zip(groups, scores.texts, scores.rewards, strict=True):
            x.texts, x.rewards = texts, rewards
            if not r.dynamic_sampling or x.carries_signal(
                r.dynamic_sampling_criterion, self.loss, r.dynamic_sampling_std_eps
            ):
                self.kept.append(x)
                c.kept += 1
            else:
                self.set_aside.append(x)
                c.dropped += 1
                reason = f"dropped_{x.composition(self.loss.success_threshold)}"
                setattr(c, reason, getattr(c, reason) + 1)

    def add_round(self, groups: list[CompletedGroup]) -> None:
        """``add`` one received round's groups and count the round for the next batch
        (``sampling/rounds``: rounds received while its batch was assembled; the scheduler calls this)."""
        self.add(groups)
        self.counters.rounds += 1

    # ------------------------------------------------------------------------------------------ rounds

    def rounds_exhausted(self) -> bool:
        """The step has drawn ``rollout.max_sampling_rounds`` rounds (dynamic sampling only)."""
        return self.rollout.dynamic_sampling and self.counters.rounds >= self.rollout.max_sampling_rounds

    def missing(self, n: int, in_flight: int = 0) -> int:
        """How many prompts the next round should draw for a batch of ``n`` groups, with ``in_flight``
        prompts already dispatched and not yet added; a nonzero answer counts one round of the step. Ask
        after a ``take`` that answered None (it has dropped the stale groups by then)."""
        have = len(self.kept) + in_flight + (len(self.set_aside) if self.rounds_exhausted() else 0)
        need = max(0, n - have)
        if need:
            self.counters.rounds += 1
        return need

    # ------------------------------------------------------------------------------------------- train

    def _is_stale(self, x: CompletedGroup, trainer_version: int, bound: int) -> bool:
        return any(trainer_version - v > bound for v in x.newest_versions())

    def take(
        self,
        n: int,
        trainer_version: int,
        bound: int,
        t_gen: float | None = None,
        step: int | None = None,
    ) -> RolloutBatch | None:
        """The step's routed batch of exactly ``n`` groups, oldest first, trained from ``trainer_version``
        with at most ``bound`` versions of staleness; None while fewer than ``n`` groups qualify (stale
        groups are dropped and counted even then). ``t_gen`` becomes ``time/generate_s`` when given.

        Rewards that failed (``trainer/collect/reward_errors.py``) are checked when a batch is answered: more
        than half of the step's rewards: a warning; all of them: ``RewardsFailed`` unless
        ``rollout.allow_reward_errors`` (``step`` names the step in the line)."""
        c = self.counters
        fresh = []
        for x in self.kept:
            if not self._is_stale(x, trainer_version, bound):
                fresh.append(x)
            elif bound == 0:  # on-policy: only a surplus of an earlier step's rounds turns stale
                c.surplus += 1
            else:
                c.dropped_stale += len(x.completions)
        self.kept = sorted(fresh, key=lambda x: x.key)
        # stale set-aside groups are never a top-up (counted once, as dropped groups)
        self.set_aside = [x for x in self.set_aside if not self._is_stale(x, trainer_version, bound)]
        chosen, short = self.kept[:n], n - min(n, len(self.kept))
        topped_up: list[CompletedGroup] = []
        if short:
            if not self.rounds_exhausted() or len(self.set_aside) < short:
                return None
            topped_up = self.set_aside[len(self.set_aside) - short :]  # the most recent ones
        check_step_rewards(
            step,
            c.rewards_scored,
            c.reward_errors + c.reward_timeouts,
            c.reward_messages,
            self.rollout.allow_reward_errors,
        )
        self.kept = self.kept[len(chosen) :]
        batch = self._route(sorted(chosen + topped_up, key=lambda x: x.key))
        times = {} if t_gen is None else {"time/generate_s": t_gen}
        times["time/reward_s"] = c.reward_s
        pool_metrics = {
            "reward/timeouts": float(c.reward_timeouts),
            "reward/errors": float(c.reward_errors),
            "sampling/rounds": float(c.rounds),
            "sampling/kept_groups": float(c.kept),
            "sampling/dropped_groups": float(c.dropped),
            "sampling/topped_up": float(len(topped_up)),
            "async/dropped_stale": float(c.dropped_stale),
        }
        if self.rollout.dynamic_sampling:  # the sampler's own counters (0 without it)
            pool_metrics.update(
                {
                    "sampling/dropped_all_correct": float(c.dropped_all_correct),
                    "sampling/dropped_all_wrong": float(c.dropped_all_wrong),
                    "sampling/dropped_mixed": float(c.dropped_mixed),
                    "sampling/surplus_groups": float(c.surplus),
                }
            )
        versions = async_metrics(batch, trainer_version)
        batch.metrics = merge_metrics(batch.metrics, times, pool_metrics, versions)
        self.set_aside, self.counters = [], _StepCounters()
        return batch

    def _route(self, groups: list[CompletedGroup]) -> RolloutBatch:
        texts, rewards = [], []
        for x in groups:
            assert x.texts is not None and x.rewards is not None, "SamplePool.add rewards every group"
            texts.append(x.texts)
            rewards.append(x.rewards)
        return route_groups(
            self.tokenizer,
            [x.prompt for x in groups],
            [x.completions for x in groups],
            texts,
            rewards,
            self.loss,
            self.teacher,
            uids=[[f"{x.dispatch}/{x.index}/{m}" for m in range(len(x.completions))] for x in groups],
        )

    # ------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Every group not yet trained (kept and set aside) and the step's counters: plain python and
        tensors, ``torch.save``-able; ``load_state_dict`` restores it exactly."""
        return copy.deepcopy(
            {
                "format": STATE_FORMAT,
                "kept": [_group_state(x) for x in self.kept],
                "set_aside": [_group_state(x) for x in self.set_aside],
                "counters": dataclasses.asdict(self.counters),
            }
        )  # a snapshot: later steps do not change a state already handed to the checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"sample pool state has format {state.get('format')!r}, this version reads {STATE_FORMAT}; "
                "resume with the version that wrote the checkpoint"
            )
        state = copy.deepcopy(state)
        self.kept = [_group_from_state(x) for x in state["kept"]]
        self.set_aside = [_group_from_state(x) for x in state["set_aside"]]
        self.counters = _StepCounters(**state["counters"])


def async_metrics(batch: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """``async/staleness_mean``/``_max`` (trainer version minus each sample's dispatch version, its oldest
    token's) and ``async/partial_share`` (share of samples whose tokens span several versions)."""
    staleness = [trainer_version - s.weight_version for s in batch.samples]
    spans = [len(set(s.token_versions or ())) > 1 for s in batch.samples]
    return {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        "async/partial_share": sum(spans) / len(spans),
    }


_COMPLETION_FIELDS = tuple(f.name for f in dataclasses.fields(Completion))


def _group_state(x: CompletedGroup) -> dict[str, Any]:
    p = x.prompt
    return {
        "prompt": {"ids": list(p.ids), "row": dataclasses.asdict(p.row), "truncated": p.truncated},
        "completions": [{k: getattr(c, k) for k in _COMPLETION_FIELDS} for c in x.completions],
        "dispatch": x.dispatch,
        "index": x.index,
        "round": x.round,
        "dataset_index": x.dataset_index,
        "texts": x.texts,
        "rewards": x.rewards,
    }


def _group_from_state(s: dict[str, Any]) -> CompletedGroup:
    p = s["prompt"]
    return CompletedGroup(
        prompt=Prompt(tuple(p["ids"]), Row(**p["row"]), p["truncated"]),
        completions=[Completion(**c) for c in s["completions"]],
        dispatch=s["dispatch"],
        index=s["index"],
        round=s["round"],
        dataset_index=s["dataset_index"],
        texts=s["texts"],
        rewards=s["rewards"],
    )
