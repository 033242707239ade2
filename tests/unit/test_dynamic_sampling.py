"""Dynamic sampling in ``trainer/collect/sample_pool.py`` (``rollout.dynamic_sampling``,
``max_sampling_rounds``).

On scripted rewards (the real ``RewardPool``, ``workers=0``, a registered ``scripted`` reward kind):

- only MIXED groups (some members pass ``loss.success_threshold``, some do not) are trained; the step
  reports its rounds, kept and dropped groups; an all-correct or all-wrong group is never trained while
  rounds remain (a planted "keep all-correct" filter is caught);
- after ``max_sampling_rounds`` rounds the batch is topped up with the MOST RECENT dropped groups and
  keeps its shape (``sampling/topped_up``); stale dropped groups are not a top-up, and when the dropped
  groups do not suffice another round is drawn;
- surplus mixed groups stay for the next step; without dynamic sampling every group is trained.
"""

from __future__ import annotations

import pytest

from srpo_megatron.config import LossConfig
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.trainer.collect.sample_pool import CompletedGroup, SamplePool
from srpo_megatron.trainer.step_types import RolloutBatch
from tests.helpers.sample_pool import ALL_CORRECT, ALL_WRONG, MIXED, group, make_pool

LOW = [0.4, 0.45, 0.3, 0.2]  # rewards differ, yet none passes 0.5: no sibling, not mixed


@pytest.fixture
def rewards():
    with RewardPool(0, 30.0) as pool:
        yield pool


def _groups_of(batch: RolloutBatch) -> list[str]:
    return [s.uid.rsplit("/", 1)[0] for s in batch.samples if s.member == 0]


SAMPLING = (
    "rounds",
    "kept_groups",
    "dropped_groups",
    "topped_up",
)  # the by-reason counters: test_sampling_criteria


def _sampling(batch: RolloutBatch) -> dict[str, float]:
    return {name: batch.metrics[f"sampling/{name}"] for name in SAMPLING}


def _three_rounds(rewards) -> RolloutBatch:
    # criterion mixed: LOW's rewards spread, so the default (auto) would keep it for SRPO's GRPO half
    pool = make_pool(
        rewards, dynamic_sampling=True, max_sampling_rounds=4, dynamic_sampling_criterion="mixed"
    )
    assert pool.missing(3) == 3
    pool.add([group(0, 0, MIXED), group(0, 1, ALL_CORRECT), group(0, 2, ALL_WRONG)])
    assert pool.take(3, trainer_version=0, bound=0) is None
    assert pool.missing(3) == 2
    pool.add([group(1, 0, LOW), group(1, 1, [0.0, 0.0, 0.0, 1.0])])
    assert pool.take(3, trainer_version=0, bound=0) is None
    assert pool.missing(3) == 1
    pool.add([group(2, 0, [0.2, 0.9, 0.1, 0.1])])
    batch = pool.take(3, trainer_version=0, bound=0)
    assert batch is not None
    assert _groups_of(batch) == ["0/0", "1/1", "2/0"]
    for i in range(3):
        correct = [s.reward >= 0.5 for s in batch.samples if s.group == i]
        assert any(correct) and not all(correct), "only mixed groups are trained"
    assert _sampling(batch) == {"rounds": 3.0, "kept_groups": 3.0, "dropped_groups": 3.0, "topped_up": 0.0}
    assert batch.metrics["reward/accuracy"] == 4 / 12  # the routing metrics are the trained groups'
    assert batch.metrics["route/fallback_frac"] == 0.0  # every failed sample has a correct sibling
    return batch


def test_dynamic_sampling_trains_only_mixed_groups_and_reports_rounds_and_drops(rewards, monkeypatch):
    _three_rounds(rewards)
    # planted: the filter keeps every group with a correct member (all-correct groups kept)
    monkeypatch.setattr(CompletedGroup, "mixed", lambda x, t: any(r >= t for r in x.rewards))
    with pytest.raises(AssertionError):
        _three_rounds(rewards)


def test_planted_filter_that_keeps_everything_is_caught(rewards, monkeypatch):
    monkeypatch.setattr(CompletedGroup, "mixed", lambda x, t: True)
    with pytest.raises(AssertionError):
        _three_rounds(rewards)


def test_the_threshold_decides_what_is_mixed(rewards):
    pool = make_pool(rewards, LossConfig(success_threshold=0.42), dynamic_sampling=True)
    pool.missing(1)
    pool.add([group(0, 0, LOW)])  # 0.45 passes 0.42, the others do not
    batch = pool.take(1, trainer_version=0, bound=0)
    assert batch is not None and _sampling(batch)["kept_groups"] == 1.0


def _topped_up(rewards) -> RolloutBatch:
    pool = make_pool(rewards, dynamic_sampling=True, max_sampling_rounds=2)
    assert pool.missing(3) == 3
    pool.add([group(0, 0, MIXED), group(0, 1, ALL_WRONG), group(0, 2, ALL_CORRECT)])
    assert pool.take(3, trainer_version=0, bound=0) is None
    assert pool.missing(3) == 2
    pool.add([group(1, 0, ALL_WRONG), group(1, 1, ALL_CORRECT)])
    batch = pool.take(3, trainer_version=0, bound=0)
    assert batch is not None
    assert len(batch.samples) == 12, "the batch keeps its shape"
    assert _groups_of(batch) == ["0/0", "1/0", "1/1"], "topped up with the most recent dropped groups"
    assert _sampling(batch) == {"rounds": 2.0, "kept_groups": 1.0, "dropped_groups": 4.0, "topped_up": 2.0}
    assert pool.set_aside == [] and pool.missing(3) == 3 and pool.counters.rounds == 1  # a fresh step
    return batch


def test_after_max_rounds_the_batch_is_topped_up_with_the_most_recent_dropped_groups(rewards, monkeypatch):
    _topped_up(rewards)
    # planted: no top-up (rounds never run out) -> the step never completes
    monkeypatch.setattr(SamplePool, "rounds_exhausted", lambda self: False)
    with pytest.raises(AssertionError):
        _topped_up(rewards)


def test_stale_dropped_groups_are_no_top_up_and_another_round_is_drawn(rewards):
    pool = make_pool(rewards, dynamic_sampling=True, max_sampling_rounds=1)
    assert pool.missing(2) == 2
    pool.add([group(0, 0, ALL_WRONG, version=5), group(0, 1, ALL_CORRECT, version=2)])  # 0/1: stale at v5
    assert pool.take(2, trainer_version=5, bound=1) is None  # one usable dropped group; rounds are out
    assert pool.missing(2) == 1, "the dropped groups do not suffice: one more round beyond the limit"
    pool.add([group(1, 0, ALL_CORRECT, version=5)])
    batch = pool.take(2, trainer_version=5, bound=1)
    assert batch is not None and _groups_of(batch) == ["0/0", "1/0"]
    assert _sampling(batch) == {"rounds": 2.0, "kept_groups": 0.0, "dropped_groups": 3.0, "topped_up": 2.0}
    assert batch.metrics["async/dropped_stale"] == 0.0  # counted once, as a dropped group


def test_surplus_mixed_groups_stay_for_the_next_step(rewards):
    pool = make_pool(rewards, dynamic_sampling=True)
    assert pool.missing(2) == 2
    pool.add([group(0, k, MIXED) for k in range(4)] + [group(0, 4, ALL_WRONG)])
    first = pool.take(2, trainer_version=0, bound=0)
    assert first is not None and _groups_of(first) == ["0/0", "0/1"]
    assert _sampling(first) == {"rounds": 1.0, "kept_groups": 4.0, "dropped_groups": 1.0, "topped_up": 0.0}
    assert pool.missing(2) == 0  # the surplus is the next batch: no round drawn
    second = pool.take(2, trainer_version=0, bound=0)
    assert second is not None and _groups_of(second) == ["0/2", "0/3"]
    assert _sampling(second) == {"rounds": 0.0, "kept_groups": 0.0, "dropped_groups": 0.0, "topped_up": 0.0}


def test_without_dynamic_sampling_every_group_is_trained(rewards):
    pool = make_pool(rewards)
    assert pool.missing(3) == 3
    pool.add([group(0, 0, MIXED), group(0, 1, ALL_CORRECT), group(0, 2, ALL_WRONG)])
    batch = pool.take(3, trainer_version=0, bound=0)
    assert batch is not None and _groups_of(batch) == ["0/0", "0/1", "0/2"]
    assert _sampling(batch) == {"rounds": 1.0, "kept_groups": 3.0, "dropped_groups": 0.0, "topped_up": 0.0}
    assert batch.metrics["route/fallback_frac"] == 4 / 12  # the all-wrong group's samples
