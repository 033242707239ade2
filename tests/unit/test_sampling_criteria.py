"""Which groups dynamic sampling keeps (``rollout.dynamic_sampling_criterion``,
``trainer/collect/sample_pool.py``),
the set-aside counters by reason, and the surplus rule at ``off_policy_steps = 0``.

- ``auto`` keeps exactly the groups whose routed loss has a nonzero term under ``loss.mode``: checked
  against the loss's own routing (``losses.routing.routing_masks``) and GRPO advantages
  (``group_advantages``, float64) on every mode over a grid of reward groups;
- a pure-SDPO run keeps all-correct groups (each member distils toward a correct sibling); a
  continuous-reward run keeps a group whose rewards spread entirely above the threshold and drops a
  constant one; ``mixed`` and ``std`` override ``auto``;
- ``sampling/dropped_all_correct`` / ``_all_wrong`` / ``_mixed`` sum to ``sampling/dropped_groups``;
- at bound 0 an earlier step's surplus is counted in ``sampling/surplus_groups``, not in
  ``async/dropped_stale`` (at bound 1 a stale group still is);
- the keys are validated, and keys that do nothing get one warning line.

Anchor for ``std``: DAPO's dynamic sampling as slime implements it (``check_reward_nonzero_std`` in
``slime/rollout/filter_hub/dynamic_sampling_filters.py`` at THUDM/slime c7c9e7d3: float64 sample std
> 1e-6) and verl's DAPO recipe (``recipe/dapo/dapo_ray_trainer.py`` at volcengine/verl 004c8880:
``np.std`` of the group's metric > 0), read, not copied.
"""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch

from srpo_megatron.config import ConfigError, ConfigWarning, LossConfig, RolloutConfig
from srpo_megatron.config.loss import MODES
from srpo_megatron.losses.routing import group_advantages, route, routing_masks
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.trainer.collect.sample_pool import CompletedGroup
from tests.helpers.recipe import RECIPE
from tests.helpers.sample_pool import ALL_CORRECT, ALL_WRONG, MIXED, group, make_pool

SPREAD_ABOVE = [0.6, 0.7, 0.8, 0.9]  # every member passes 0.5, yet the rewards differ
CONSTANT = [0.7] * 4
REASONS = ("all_correct", "all_wrong", "mixed")


@pytest.fixture
def rewards():
    with RewardPool(0, 30.0) as pool:
        yield pool


def _loss_has_a_term(rewards: list[float], loss: LossConfig) -> bool:
    """Independent of the sampler: does the routed loss of this group have a nonzero term? From the
    loss's routing masks and float64 GRPO advantages (advantage_mix: the GRPO term needs λ > 0 and a
    nonzero advantage, the SDPO advantage needs λ < 1 and a teacher)."""
    r = torch.tensor([rewards], dtype=torch.float64)
    routing = route(r, loss.success_threshold)
    grpo, sdpo, teacher = routing_masks(routing, loss.mode)
    adv = group_advantages(r, loss.std_normalize, loss.std_eps)
    grpo_term = bool((grpo & (adv != 0)).any())
    if loss.mode == "advantage_mix":
        lam = loss.adv_mix_lambda
        return (lam > 0 and grpo_term) or (lam < 1 and bool(teacher.any()))
    return grpo_term or bool(sdpo.any())


GRID = [list(g) for g in itertools.product([0.0, 1.0], repeat=4)] + [
    SPREAD_ABOVE,
    CONSTANT,
    [0.1, 0.2, 0.2, 0.4],
]


CASES = [(mode, 0.9) for mode in MODES] + [("advantage_mix", 0.0), ("advantage_mix", 1.0)]


@pytest.mark.parametrize(("mode", "lam"), CASES)
def test_auto_keeps_exactly_the_groups_whose_loss_has_a_term(mode, lam):
    loss = LossConfig(mode=mode, adv_mix_lambda=lam)
    for rewards in GRID:
        x = group(0, 0, rewards)
        x.rewards = rewards
        assert x.carries_signal("auto", loss, 1e-6) == _loss_has_a_term(rewards, loss), (mode, lam, rewards)


def _one_round(rewards_pool, loss, groups, **rollout):
    pool = make_pool(rewards_pool, loss, dynamic_sampling=True, max_sampling_rounds=1, **rollout)
    n = len(groups)
    assert pool.missing(n) == n
    pool.add([group(0, i, g) for i, g in enumerate(groups)])
    batch = pool.take(n, trainer_version=0, bound=0)  # rounds are out: topped up with the set-aside ones
    assert batch is not None
    return {k.split("/", 1)[1]: v for k, v in batch.metrics.items() if k.startswith("sampling/")}


def test_pure_sdpo_keeps_all_correct_groups_and_counts_the_rest_by_reason(rewards):
    m = _one_round(rewards, LossConfig(mode="sdpo"), [ALL_CORRECT, MIXED, ALL_WRONG])
    assert m["kept_groups"] == 2.0, "an all-correct group carries SDPO signal"
    assert (m["dropped_groups"], m["dropped_all_wrong"], m["dropped_all_correct"]) == (1.0, 1.0, 0.0)
    srpo = _one_round(rewards, LossConfig(mode="srpo"), [ALL_CORRECT, MIXED, ALL_WRONG])
    assert srpo["kept_groups"] == 1.0 and srpo["dropped_all_correct"] == 1.0 == srpo["dropped_all_wrong"]
    assert sum(srpo[f"dropped_{r}"] for r in REASONS) == srpo["dropped_groups"]


@pytest.mark.parametrize("mode", ["srpo", "grpo"])
def test_continuous_rewards_keep_a_spread_above_the_threshold_and_drop_a_constant_group(rewards, mode):
    m = _one_round(rewards, LossConfig(mode=mode), [SPREAD_ABOVE, CONSTANT])
    assert (m["kept_groups"], m["dropped_groups"], m["dropped_all_correct"]) == (1.0, 1.0, 1.0)
    std = _one_round(
        rewards, LossConfig(mode="srpo"), [SPREAD_ABOVE, CONSTANT], dynamic_sampling_criterion="std"
    )
    assert std["kept_groups"] == 1.0
    mixed = _one_round(
        rewards, LossConfig(mode=mode), [SPREAD_ABOVE, CONSTANT], dynamic_sampling_criterion="mixed"
    )
    assert mixed["kept_groups"] == 0.0 and mixed["dropped_all_correct"] == 2.0, "mixed: both are all-correct"


def test_planted_mixed_rule_for_every_mode_is_caught(rewards, monkeypatch):
    """The old rule (mixed, whatever loss.mode and the rewards) fails both tests above."""
    monkeypatch.setattr(CompletedGroup, "carries_signal", lambda x, c, loss, eps: x.mixed(0.5))
    with pytest.raises(AssertionError, match="carries SDPO signal"):
        test_pure_sdpo_keeps_all_correct_groups_and_counts_the_rest_by_reason(rewards)
    with pytest.raises(AssertionError):
        test_continuous_rewards_keep_a_spread_above_the_threshold_and_drop_a_constant_group(rewards, "srpo")


def test_std_eps_decides_what_is_constant(rewards):
    close = [0.7, 0.7, 0.7, 0.7 + 1e-9]
    loss = LossConfig(mode="grpo")
    assert _one_round(rewards, loss, [close])["kept_groups"] == 0.0  # std 5e-10 <= 1e-6
    assert _one_round(rewards, loss, [close], dynamic_sampling_std_eps=0.0)["kept_groups"] == 1.0


def test_std_criterion_sets_mixed_groups_aside_when_they_do_not_spread(rewards):
    m = _one_round(rewards, LossConfig(success_threshold=0.7), [[0.7, 0.7, 0.7, 0.7 - 1e-9]],
                   dynamic_sampling_criterion="std")  # fmt: skip
    assert m["dropped_mixed"] == 1.0


def test_surplus_at_bound_0_is_counted_as_sampling_surplus_not_as_stale(rewards):
    pool = make_pool(rewards, dynamic_sampling=True)
    assert pool.missing(2) == 2
    pool.add([group(0, k, MIXED, version=1) for k in range(4)])  # one round answers 4 groups for 2
    first = pool.take(2, trainer_version=1, bound=0)
    assert first is not None and first.metrics["sampling/surplus_groups"] == 0.0
    assert pool.take(2, trainer_version=2, bound=0) is None  # the next step: the surplus is a version old
    pool.add([group(1, k, MIXED, version=2) for k in range(2)])
    second = pool.take(2, trainer_version=2, bound=0)
    assert second is not None
    assert second.metrics["sampling/surplus_groups"] == 2.0
    assert second.metrics["async/dropped_stale"] == 0.0, "an on-policy run drops nothing as stale"
    # off-policy (bound 1): a group older than the bound is stale, as before
    off = make_pool(rewards, dynamic_sampling=True)
    off.add([group(0, k, MIXED, version=1) for k in range(2)] + [group(0, 2, MIXED, version=3)])
    off.add([group(1, 0, MIXED, version=3)])
    batch = off.take(2, trainer_version=3, bound=1)
    assert batch is not None
    assert batch.metrics["async/dropped_stale"] == 8.0 and batch.metrics["sampling/surplus_groups"] == 0.0


def test_without_dynamic_sampling_the_counters_are_not_reported(rewards):
    pool = make_pool(rewards)
    pool.add([group(0, 0, ALL_CORRECT), group(0, 1, MIXED)])
    batch = pool.take(2, trainer_version=0, bound=0)
    assert batch is not None and "sampling/dropped_all_correct" not in batch.metrics


# ----------------------------------------------------------------------------------------- the keys


def test_the_criterion_keys_are_validated():
    with pytest.raises(
        ConfigError, match=re.escape("rollout.dynamic_sampling_criterion='signal' is not a criterion")
    ):
        RolloutConfig(dynamic_sampling=True, dynamic_sampling_criterion="signal")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling_std_eps=-1.0 must be >= 0"):
        RolloutConfig(dynamic_sampling=True, dynamic_sampling_std_eps=-1.0)
    from srpo_megatron.config import load_recipe

    with pytest.raises(ConfigError, match="dynamic_sampling_criterion"):
        load_recipe(RECIPE, ["rollout.dynamic_sampling_criterion=sometimes"])


def _warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, ConfigWarning)]


def test_keys_that_do_nothing_get_one_warning_line():
    from srpo_megatron.config import load_recipe

    assert _warnings(lambda: load_recipe(RECIPE)) == [], "the defaults warn about nothing"
    assert _warnings(lambda: load_recipe(RECIPE, ["rollout.max_sampling_rounds=4"])) == []  # the default
    (line,) = _warnings(lambda: load_recipe(RECIPE, ["rollout.max_sampling_rounds=3"]))
    assert line.startswith(
        "rollout.max_sampling_rounds=3 does nothing while rollout.dynamic_sampling is false"
    )
    assert "set rollout.dynamic_sampling=true or drop the key" in line
    on = [
        "rollout.dynamic_sampling=true",
        "rollout.max_sampling_rounds=3",
        "rollout.dynamic_sampling_criterion=std",
    ]
    assert _warnings(lambda: load_recipe(RECIPE, on)) == []
    (line,) = _warnings(lambda: load_recipe(RECIPE, ["loss.mask_stale_tokens=true"]))
    assert line.startswith("loss.mask_stale_tokens=true does nothing at rollout.off_policy_steps=0")
