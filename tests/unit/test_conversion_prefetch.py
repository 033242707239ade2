"""``conversion/prefetch.Prefetched``: the import's next group made in a worker while one is written."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.conversion.prefetch import Prefetched


def _group(numel: int) -> list:
    return [SimpleNamespace(local_shape=(numel,), dtype=torch.bfloat16)]


def test_groups_come_back_in_order_and_only_small_ones_are_made_ahead():
    groups = [_group(10), _group(10), _group(1000), _group(10)]
    made = []

    def data_of(group):
        i = next(k for k, g in enumerate(groups) if g is group)
        made.append((i, threading.current_thread().name))
        return [i]

    with Prefetched(data_of, groups, budget=100) as prefetched:
        got = [prefetched(g) for g in groups]
    assert got == [[0], [1], [2], [3]]
    ahead = {i for i, thread in made if thread.startswith("conversion-prefetch")}
    assert ahead == {1, 3}  # group 2 (2,000 bytes) is over the budget: made when asked, not ahead
    assert sorted(i for i, _ in made) == [0, 1, 2, 3]  # each made once


def test_an_error_made_ahead_reaches_the_caller():
    groups = [_group(1), _group(1)]

    def data_of(group):
        if group is groups[1]:
            raise ValueError("bad tensor")
        return []

    with Prefetched(data_of, groups) as prefetched:
        prefetched(groups[0])
        with pytest.raises(ValueError, match="bad tensor"):
            prefetched(groups[1])
