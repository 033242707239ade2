"""EpochSampler: per-epoch permutations from (seed, epoch), and a checkpointed cursor resumes exactly."""

from __future__ import annotations

import copy
import random

import pytest

from srpo_megatron.data import DataError, EpochSampler


def reference_stream(n, seed, total):
    """Independent reference: concatenated per-epoch permutations from random.Random(f"{seed}/{epoch}")."""
    out, epoch = [], 0
    while len(out) < total:
        perm = list(range(n))
        random.Random(f"{seed}/{epoch}").shuffle(perm)
        out += perm
        epoch += 1
    return out[:total]


def test_batches_follow_per_epoch_permutations_across_boundaries():
    s = EpochSampler(10, seed=3)
    got = [i for _ in range(7) for i in s.next_indices(4)]  # 28 draws: crosses two epoch boundaries
    assert got == reference_stream(10, 3, 28)
    assert sorted(got[:10]) == list(range(10)) and sorted(got[10:20]) == list(range(10))
    assert got[:10] != got[10:20]  # reshuffled each epoch
    assert s.state_dict() == {"n": 10, "seed": 3, "shuffle": True, "epoch": 2, "cursor": 8}


def test_resume_from_state_dict_equals_uninterrupted_run():
    full = EpochSampler(13, seed=7)
    expected = [full.next_indices(5) for _ in range(9)]
    first = EpochSampler(13, seed=7)
    head = [first.next_indices(5) for _ in range(4)]
    state = copy.deepcopy(first.state_dict())
    resumed = EpochSampler(13, seed=7)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices(5) for _ in range(5)] == expected


def test_no_shuffle_is_file_order_and_mismatched_state_is_refused():
    s = EpochSampler(4, seed=0, shuffle=False)
    assert s.next_indices(6) == [0, 1, 2, 3, 0, 1]
    other = EpochSampler(5, seed=0)
    with pytest.raises(DataError, match="same data files"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="empty dataset"):
        EpochSampler(0)
