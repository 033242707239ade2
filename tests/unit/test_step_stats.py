"""StepStats: each field reduces as it declares (sum or max), and one function does it everywhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srpo_megatron.trainer.observe.stats import reduce_stats
from srpo_megatron.trainer.step_types import MAX, SUM, StepStats


def test_every_field_declares_sum_or_max():
    for f in dataclasses.fields(StepStats):
        assert f.metadata.get("reduce") in (SUM, MAX), f.name


def test_reduce_sums_counts_and_takes_maxima():
    a = StepStats(loss=1.0, tokens=10, rollout_logp_gap_max=0.5, skipped=0.0, train_s=2.0)
    b = StepStats(loss=2.0, tokens=5, rollout_logp_gap_max=0.2, skipped=1.0, train_s=3.0)
    r = reduce_stats([a, b])
    assert (r.loss, r.tokens, r.rollout_logp_gap_max, r.skipped, r.train_s) == (3.0, 15, 0.5, 1.0, 3.0)
    assert reduce_stats([]) == StepStats()


def test_duplicated_ranks_count_once():
    s = StepStats(loss=1.0, tokens=4, lr=1e-3, score_s=1.5)
    dup = s.counted_once(False)
    assert (dup.loss, dup.tokens, dup.lr, dup.score_s) == (0.0, 0.0, 1e-3, 1.5)
    assert reduce_stats([s, dup]).tokens == 4


def test_routed_loss_metrics_map_to_fields_and_unknown_keys_fail():
    s = StepStats.from_metrics({"tokens": torch.tensor(3.0), "grpo_clipped_sum": torch.tensor(1.0)}, loss=0.5)
    assert (s.tokens, s.grpo_clipped_sum, s.loss) == (3.0, 1.0, 0.5)
    with pytest.raises(KeyError, match="bogus"):
        StepStats.from_metrics({"bogus": torch.tensor(1.0)})
