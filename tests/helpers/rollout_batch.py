"""One on-policy rollout batch in one call: ``reward_groups`` then ``route_groups`` on every group, as the
trainer's ``SamplePool`` does for a step's groups (``trainer/collect/sample_pool.py``). Tests build batches
with it; the trainer itself goes through the pool.
"""

from __future__ import annotations

from typing import Any

from srpo_megatron.config import LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import Completion
from srpo_megatron.trainer.collect.sample_routing import check_group_sizes, reward_groups, route_groups
from srpo_megatron.trainer.step_types import RolloutBatch, merge_metrics


def route_rollouts(
    tokenizer: Any,
    prompts: list[Prompt],
    completions: list[list[Completion]],
    rollout: RolloutConfig,
    loss: LossConfig,
    teacher: TeacherConfig,
    rewards: RewardPool,
    t_gen: float,
) -> RolloutBatch:
    """Rank 0: rewards, routing, advantages and teacher prompts for ``completions[prompt][sample]``; each
    ``Sample`` is built once with all its fields, in prompt then member order (``reward_groups`` then
    ``route_groups``)."""
    check_group_sizes([len(c) for c in completions], rollout.group_size)
    scores = reward_groups(tokenizer, prompts, completions, rewards)
    batch = route_groups(tokenizer, prompts, completions, scores.texts, scores.rewards, loss, teacher)
    times = {"time/generate_s": t_gen, "time/reward_s": scores.seconds}
    return RolloutBatch(batch.samples, merge_metrics(batch.metrics, times, scores.result.metrics()))
