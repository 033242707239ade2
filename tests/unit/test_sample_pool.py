"""``trainer/collect/sample_pool.py``: rank 0's completed groups between the engines and the step's batch.

- On-policy (no dynamic sampling, bound 0) the pool's batch is today's ``route_rollouts`` batch: the same
  ``Sample`` s in the same order, field by field, and the same metric values for every existing name
  (checked against a verbatim copy of the function as it was before rewarding and routing were split);
  ``route_rollouts`` itself is unchanged too, and now carries each completion's versions.
- Staleness: a group with a member staler than the bound is dropped, counted per sample
  (``async/dropped_stale``) and never trained; a partial rollout is measured by its NEWEST token.
- Oldest groups first by (dispatch, index); the surplus stays for the next step; uids are
  ``dispatch/index/member``; the staleness and partial-share metrics are those of the trained samples.
- ``state_dict`` / ``load_state_dict`` round-trips losslessly through ``torch.save`` (routed experts and
  token versions included): a restored pool answers the same batch.

Planted bugs are run inside the tests (``monkeypatch``) to show the checks catch them.
"""

from __future__ import annotations

import dataclasses
import io
import time

import pytest
import torch

from srpo_megatron.config import LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.losses import group_advantages, route, routing_masks
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.routed_experts import compact_ids
from srpo_megatron.trainer.collect.sample_pool import CompletedGroup, SamplePool, groups_of
from srpo_megatron.trainer.collect.sample_routing import teacher_prompt_ids
from srpo_megatron.trainer.step_types import RolloutBatch, Sample, merge_metrics
from tests.helpers.rollout_batch import route_rollouts
from tests.helpers.sample_pool import (
    ALL_CORRECT,
    ALL_WRONG,
    MIXED,
    CharTokenizer,
    completion,
    group,
    make_pool,
)


@pytest.fixture
def rewards():
    with RewardPool(0, 30.0) as pool:
        yield pool


def _route_rollouts_before(tokenizer, prompts, completions, rollout, loss, teacher, rewards, t_gen):
    """``route_rollouts`` (then in ``trainer/rollouts.py``) as it was at e7f52f8, verbatim but for the
    docstring."""
    rows = [
        (i, m, c)
        for i, (_, group) in enumerate(zip(prompts, completions, strict=True))
        for m, c in enumerate(group)
    ]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, _, c in rows]
    t1 = time.monotonic()
    scored = rewards.score(
        [prompts[i].row.kind for i, _, _ in rows], texts, [prompts[i].row.answer for i, _, _ in rows]
    )
    t_reward = time.monotonic() - t1
    b, g = len(prompts), rollout.group_size
    r = torch.tensor(scored.rewards, dtype=torch.float64).view(b, g)
    routing = route(r, loss.success_threshold)
    grpo, sdpo, needs_teacher = routing_masks(routing, loss.mode)
    adv = group_advantages(r, loss.std_normalize, loss.std_eps)
    samples: list[Sample] = []
    for i, j, c in rows:
        context = None
        if needs_teacher[i, j]:
            sib = int(routing.sibling[i, j])
            context = teacher_prompt_ids(tokenizer, prompts[i], texts[i * g + sib], teacher)
        samples.append(
            Sample(
                i,
                j,
                list(prompts[i].ids),
                list(c.token_ids),
                list(c.logprobs),
                reward=float(r[i, j]),
                advantage=float(adv[i, j]),
                grpo=bool(grpo[i, j]),
                sdpo=bool(sdpo[i, j]),
                needs_teacher=bool(needs_teacher[i, j]),
                teacher_prompt_ids=context,
                finish_reason=c.finish_reason,
                routed_experts=None if c.routed_experts is None else compact_ids(c.routed_experts),
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
        "route/sdpo_loss_frac": sdpo.double().mean().item(),
        "samples/routed_to_teacher": float(sum(s.needs_teacher for s in samples)),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n,
        "time/generate_s": t_gen,
        "time/reward_s": t_reward,
    }
    return RolloutBatch(samples, merge_metrics(metrics, scored.metrics()))


def _on_policy_groups() -> list[CompletedGroup]:
    """Mixed, all-correct, all-wrong and fractional-reward groups; routed experts, truncations and a
    ``<think>`` block in the sibling the teacher is shown."""
    first = group(0, 0, MIXED, experts=True)
    first.completions[0] = completion(1.0, "d0m0<think>scratch</think>42", experts=True)
    big = first.completions[2]
    big.routed_experts = big.routed_experts + 300  # int16 after compaction (the others uint8)
    return [
        first,
        group(0, 1, ALL_CORRECT),
        group(0, 2, ALL_WRONG, finish="length"),
        group(0, 3, [0.3, 0.7, 0.7, 0.2]),
    ]


_OLD_FIELDS = [f.name for f in dataclasses.fields(Sample) if f.name not in ("uid", "weight_version")]


def _same_sample(a: Sample, b: Sample, fields=_OLD_FIELDS) -> None:
    for name in fields:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), name
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert type(x) is type(y) and x == y, (name, x, y)


def _same_batch(new: RolloutBatch, old: RolloutBatch, fields=_OLD_FIELDS) -> None:
    assert len(new.samples) == len(old.samples)
    for a, b in zip(new.samples, old.samples, strict=True):
        _same_sample(a, b, fields)
    for name, value in old.metrics.items():
        if name != "time/reward_s":  # wall clock
            assert new.metrics[name] == value, name  # exact: the same float64 arithmetic


@pytest.mark.parametrize(
    ("mode", "std_normalize"),
    [("srpo", False), ("srpo", True), ("grpo", True), ("sdpo", False), ("advantage_mix", False)],
)
def test_on_policy_pool_batch_is_todays_route_rollouts_batch(rewards, mode, std_normalize):
    loss = LossConfig(mode=mode, std_normalize=std_normalize)
    rollout = RolloutConfig(prompts_per_step=4, group_size=4)
    tok, teacher, groups = CharTokenizer(), TeacherConfig(), _on_policy_groups()
    prompts, completions = [x.prompt for x in groups], [x.completions for x in groups]
    old = _route_rollouts_before(tok, prompts, completions, rollout, loss, teacher, rewards, 1.5)
    assert any(s.needs_teacher for s in old.samples) or mode == "grpo"

    now = route_rollouts(tok, prompts, completions, rollout, loss, teacher, rewards, 1.5)
    _same_batch(now, old, [f.name for f in dataclasses.fields(Sample)])  # uid "" and version 0 as before
    assert list(now.metrics) == list(old.metrics)

    pool = SamplePool(tok, rollout, loss, teacher, rewards)
    assert pool.missing(4) == 4
    pool.add(groups)
    batch = pool.take(4, trainer_version=0, bound=0, t_gen=1.5)
    assert batch is not None
    _same_batch(batch, old)
    assert [s.uid for s in batch.samples] == [f"0/{i}/{m}" for i in range(4) for m in range(4)]
    assert list(batch.metrics)[: len(old.metrics)] == list(old.metrics)
    assert {k: batch.metrics[k] for k in batch.metrics if k.startswith(("sampling/", "async/"))} == {
        "sampling/rounds": 1.0,
        "sampling/kept_groups": 4.0,
        "sampling/dropped_groups": 0.0,
        "sampling/topped_up": 0.0,
        "async/dropped_stale": 0.0,
        "async/staleness_mean": 0.0,
        "async/staleness_max": 0.0,
        "async/partial_share": 0.0,
    }

    one_by_one = SamplePool(tok, rollout, loss, teacher, rewards)  # groups arriving singly: same batch
    for x in reversed(_on_policy_groups()):
        one_by_one.add([x])
    again = one_by_one.take(4, trainer_version=0, bound=0, t_gen=1.5)
    assert again is not None
    _same_batch(again, old)


def test_route_rollouts_carries_each_completions_versions(rewards):
    rollout, tok = RolloutConfig(prompts_per_step=1, group_size=4), CharTokenizer()
    x = group(0, 0, MIXED, version=3, newest=[None, 5, None, 4])
    batch = route_rollouts(
        tok, [x.prompt], [x.completions], rollout, LossConfig(), TeacherConfig(), rewards, 0
    )
    assert [s.weight_version for s in batch.samples] == [3] * 4
    assert [s.token_versions for s in batch.samples] == [c.token_versions for c in x.completions]
    assert batch.samples[1].token_versions[-1] == 5 and batch.samples[0].token_versions is None


# --------------------------------------------------------------------------------------------- staleness


def test_a_stale_group_is_dropped_and_counted_per_sample_never_trained(rewards):
    pool = make_pool(rewards)
    fresh, stale = group(0, 0, MIXED, version=4), group(0, 1, MIXED, version=4)
    stale.completions[2].weight_version = 2  # one member 3 versions behind the trainer (bound 1)
    pool.add([fresh, stale, group(1, 0, MIXED, version=5)])
    batch = pool.take(2, trainer_version=5, bound=1)
    assert batch is not None
    assert {s.uid.rsplit("/", 1)[0] for s in batch.samples} == {"0/0", "1/0"}
    assert batch.metrics["async/dropped_stale"] == 4.0  # the stale group's 4 samples
    assert batch.metrics["async/staleness_max"] == 1.0 and batch.metrics["async/staleness_mean"] == 0.5
    assert pool.kept == [] and pool.counters.dropped_stale == 0  # counters start again for the next step


def test_stale_groups_are_dropped_even_when_the_batch_is_not_ready(rewards):
    pool = make_pool(rewards)
    pool.add([group(0, 0, MIXED, version=1), group(0, 1, MIXED, version=3)])
    assert pool.take(2, trainer_version=3, bound=1) is None  # 0/0 is stale: only one group qualifies
    assert [x.key for x in pool.kept] == [(0, 1)] and pool.counters.dropped_stale == 4
    assert pool.missing(2) == 1
    pool.add([group(1, 0, MIXED, version=3)])
    batch = pool.take(2, trainer_version=3, bound=1)
    assert batch is not None and batch.metrics["async/dropped_stale"] == 4.0


def _partial_scenario(rewards) -> RolloutBatch:
    """Partial rollouts dispatched at v2, the trainer at v5, bound 1: a member whose last token came from
    v4 is fresh enough (its older tokens are the loss's business); one whose newest token is v3 is not."""
    pool = make_pool(rewards)
    pool.add([group(0, 0, MIXED, version=2, newest=[4, 4, 4, 4])])  # newest token v4: 1 behind
    pool.add([group(0, 1, MIXED, version=2, newest=[4, 3, 4, 4])])  # member 1's newest token v3: stale
    pool.add([group(1, 0, MIXED, version=5)])
    batch = pool.take(2, trainer_version=5, bound=1)
    assert batch is not None
    assert {s.uid.rsplit("/", 1)[0] for s in batch.samples} == {"0/0", "1/0"}
    assert batch.metrics["async/dropped_stale"] == 4.0
    # staleness of a trained sample is its dispatch version's (its oldest token): 3 for the partial ones
    assert batch.metrics["async/staleness_max"] == 3.0 and batch.metrics["async/staleness_mean"] == 1.5
    assert batch.metrics["async/partial_share"] == 0.5
    assert batch.samples[0].weight_version == 2 and batch.samples[0].token_versions[-1] == 4
    return batch


def test_a_partial_rollout_is_measured_by_its_newest_token(rewards, monkeypatch):
    _partial_scenario(rewards)
    # planted: measured by the oldest token (the dispatch version) -> the fresh partial group is dropped
    monkeypatch.setattr(
        CompletedGroup, "newest_versions", lambda x: [c.weight_version for c in x.completions]
    )
    with pytest.raises(AssertionError):
        _partial_scenario(rewards)


def test_planted_stale_group_trained_is_caught(rewards, monkeypatch):
    monkeypatch.setattr(SamplePool, "_is_stale", lambda self, x, v, b: False)
    with pytest.raises(AssertionError):
        _partial_scenario(rewards)


# ------------------------------------------------------------------------------------ order and surplus


def test_oldest_groups_first_and_the_surplus_stays_for_the_next_step(rewards):
    pool = make_pool(rewards)
    arrivals = [group(1, 1, MIXED), group(1, 0, MIXED), group(0, 2, MIXED), group(0, 0, MIXED)]  # young first
    pool.add(arrivals[:2])
    pool.add(arrivals[2:])
    first = pool.take(3, trainer_version=0, bound=0)
    assert first is not None
    assert [s.uid for s in first.samples[::4]] == ["0/0/0", "0/2/0", "1/0/0"]
    assert [s.group for s in first.samples[::4]] == [0, 1, 2]  # batch positions, in age order
    assert [x.key for x in pool.kept] == [(1, 1)] and pool.missing(3) == 2
    assert first.metrics["sampling/kept_groups"] == 4.0
    pool.add([group(2, 0, MIXED), group(2, 1, MIXED)])
    second = pool.take(3, trainer_version=0, bound=0)
    assert second is not None
    assert [s.uid for s in second.samples[::4]] == ["1/1/0", "2/0/0", "2/1/0"]
    assert second.metrics["sampling/kept_groups"] == 2.0 and second.metrics["sampling/rounds"] == 1.0


def test_take_needs_exactly_n_groups(rewards):
    pool = make_pool(rewards)
    assert pool.take(2, trainer_version=0, bound=0) is None
    x = group(0, 0, MIXED)
    pool.add(groups_of(0, [x.prompt], [x.completions], round=1, dataset_indices=[7]))
    first = pool.kept[0]
    assert len(pool) == 1 and (first.key, first.round, first.dataset_index) == ((0, 0), 1, 7)
    assert pool.take(2, trainer_version=0, bound=0) is None
    assert pool.missing(2) == 1 and pool.missing(2, in_flight=1) == 0
    with pytest.raises(ValueError, match="group_size = 4"):
        pool.add([CompletedGroup(group(0, 1, MIXED).prompt, [completion(1.0, "x")], 0, 1)])


# ------------------------------------------------------------------------------------------- checkpoints


def _pool_with_everything(rewards) -> SamplePool:
    pool = make_pool(rewards, dynamic_sampling=True, max_sampling_rounds=2)
    assert pool.missing(2) == 2
    x = group(3, 0, MIXED, version=2, newest=[3, None, 4, 3], experts=True)
    x.completions[1].meta = {"sample": 1}
    pool.add([x, group(3, 1, ALL_WRONG, version=2), group(3, 2, ALL_CORRECT, version=3)])
    pool.take(2, trainer_version=3, bound=2)  # not ready: counters stay
    return pool


def _same_state(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _same_state(u, v)
    else:
        assert type(a) is type(b) and a == b


def test_state_dict_round_trips_through_torch_save_and_trains_the_same_batch(rewards):
    pool = _pool_with_everything(rewards)
    state = pool.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = make_pool(rewards, dynamic_sampling=True, max_sampling_rounds=2)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    _same_state(restored.state_dict(), state)
    assert restored.counters == pool.counters and restored.counters.rounds == 1
    assert restored.kept[0].completions[0].token_versions == pool.kept[0].completions[0].token_versions
    assert restored.kept[0].completions[1].meta == {"sample": 1}

    assert len(state["kept"]) == 1 and len(state["set_aside"]) == 2
    for p in (pool, restored):
        assert p.missing(2) == 1  # the second and last round; nothing comes back: the batch is topped up
    a, b = pool.take(2, trainer_version=3, bound=2), restored.take(2, trainer_version=3, bound=2)
    assert a is not None and b is not None
    _same_batch(b, a, [f.name for f in dataclasses.fields(Sample)])
    assert [s.uid for s in b.samples[::4]] == ["3/0/0", "3/2/0"]  # the restored set-aside group tops up
    assert b.metrics["sampling/rounds"] == 2.0 and b.metrics["sampling/dropped_groups"] == 2.0
    assert b.metrics["sampling/topped_up"] == 1.0
    assert b.samples[0].routed_experts is not None and b.samples[2].token_versions[-1] == 4


def test_state_dict_is_a_snapshot_and_refuses_another_format(rewards):
    pool = _pool_with_everything(rewards)
    state = pool.state_dict()
    pool.kept[0].completions[0].token_ids.append(7)
    assert state["kept"][0]["completions"][0]["token_ids"][-1] != 7
    with pytest.raises(ValueError, match="format"):
        pool.load_state_dict({**state, "format": 0})
