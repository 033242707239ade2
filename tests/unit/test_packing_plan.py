"""Token-budget planning, THD packing and the CP split (pure bookkeeping, hand-checked cases)."""

from __future__ import annotations

import random

import pytest
import torch

from srpo_megatron.trainer.microbatches.packing import (
    cp_index,
    cp_shard,
    pack,
    pad_multiple,
    padding_waste,
    plan_micro_batches,
)

pytestmark = pytest.mark.packing


def test_first_fit_decreasing_hand_case():
    # sorted: 9(2) 7(4) 5(0) 3(1) 2(3) 1(5); budget 12: [9,3] [7,5] [2,1]
    assert plan_micro_batches([5, 3, 9, 2, 7, 1], 12) == [[1, 2], [0, 4], [3, 5]]


def test_plan_places_every_sample_once_within_budget():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        multiple = rng.choice([1, 2, 4, 8])
        budget = multiple * rng.randint(-(-40 // multiple), 60)
        bins = plan_micro_batches(lengths, budget, multiple)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        for b in bins:
            assert b == sorted(b)
            assert sum(-(-lengths[i] // multiple) * multiple for i in b) <= budget
        # FFD never needs more than 11/9·OPT + 1 bins; OPT ≥ total / budget
        padded = sum(-(-n // multiple) * multiple for n in lengths)
        assert len(bins) <= 11 / 9 * -(-padded // budget) + 1


def test_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"sample 1 needs 20 tokens.*max_tokens_per_micro_batch=16"):
        plan_micro_batches([4, 20], 16)
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        plan_micro_batches([4], 18, 4)


def test_pad_multiple():
    assert pad_multiple(tp=4, cp=1, sequence_parallel=False) == 1
    assert pad_multiple(tp=4, cp=1, sequence_parallel=True) == 4
    assert pad_multiple(tp=2, cp=2, sequence_parallel=True) == 8
    assert pad_multiple(tp=2, cp=2, sequence_parallel=False) == 4


def test_pack_layout_rows_and_pipeline_padding():
    seqs = [([1, 2, 3, 4, 5], 1, 3), ([6, 7, 8], 2, 1), ([9, 9], 1, 1)]
    mb = pack(seqs, [0, 2], multiple=4, total=16)
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 9, 9, 0, 0, 0, 0, 0, 0]]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert mb.rows[0].nonzero().flatten().tolist() == [1, 2, 3, 9]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 7]  # the trailing PP padding sequence has no real token
    assert mb.cu_seqlens_padded.tolist() == [0, 8, 12, 16]
    assert mb.max_seqlen == 8
    with pytest.raises(ValueError, match="cannot pad"):
        pack(seqs, [0, 1, 2], multiple=4, total=12)


def test_cp_split_partitions_every_sequence_into_balanced_chunks():
    cu = torch.tensor([0, 8, 12, 28], dtype=torch.int32)
    assert cp_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 15, 24, 25, 26, 27]
    assert cp_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 16, 17, 18, 19, 20, 21, 22, 23]
    for cp in (1, 2):
        got = torch.cat([cp_index(cu, cp, r) for r in range(cp)]).sort().values
        assert got.tolist() == list(range(28))
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        cp_index(torch.tensor([0, 6]), 2, 0)


def test_cp_shard_rows_index_the_flat_token_order():
    seqs = [(list(range(1, 9)), 0, 7), (list(range(1, 5)), 1, 2)]
    mb = pack(seqs, [0, 1], multiple=4)
    flat = mb.tokens[0][mb.rows[0]]  # what the per-token tensors are aligned with
    seen = []
    for r in range(2):
        sh = cp_shard(mb, 2, r)
        assert sh.row_index.tolist() == sorted(sh.row_index.tolist())  # an ordered subset
        assert torch.equal(sh.tokens[0][sh.rows[0]], flat[sh.row_index])
        seen += sh.row_index.tolist()
    assert sorted(seen) == list(range(flat.numel()))


def test_padding_waste():
    assert padding_waste([3, 5], [[0, 1]], budget=None, multiple=4) == 12 / 8
    assert padding_waste([3, 5], [[0, 1]], budget=16) == 2.0
