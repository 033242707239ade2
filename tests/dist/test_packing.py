"""Packed (THD) micro-batches through a real megatron GPTModel equal each sequence run on its own.

The reference is the independent transformers model (fp32) run on every sequence separately; the policy
runs token-budget micro-batches (first-fit decreasing) packed end to end through megatron's schedules,
with the project's SDPA core attention honouring ``PackedSeqParams``. Checked: logits of every predicted
row and every gradient ≤ 1e-5 at several budgets, at TP1, and with context parallelism at CP2, TP2×CP2 and
CP2×PP2 (each sequence split into 2·CP load-balanced chunks, K/V gathered over the CP group). A
perturbation test shows no token attends across a sequence boundary.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from srpo_megatron.testing.tiny import tiny_hf_model
from tests.helpers.packing import (
    LENGTHS,
    VOCAB,
    assert_close,
    hf_reference,
    packed_sequences,
    run_packed,
)

pytestmark = pytest.mark.packing

BUDGETS = (16, 24, 64)  # 16: about one sequence per micro-batch; 64: all but one in the first


def test_packed_equals_separate_sequences_and_never_crosses_a_boundary():
    hf = tiny_hf_model("qwen3", seed=1)
    seqs = packed_sequences()
    # The same packing with sequence 2 replaced: only its own rows may change.
    victim = 2
    gen = torch.Generator().manual_seed(99)
    perturbed = [list(s) for s in seqs]
    perturbed[victim] = torch.randint(0, VOCAB, (len(seqs[victim]),), generator=gen).tolist()
    cases = [(seqs, b) for b in BUDGETS] + [(perturbed, b) for b in BUDGETS]
    results = run_packed(1, 1, 1, hf, cases)
    want = hf_reference(hf, seqs)
    for budget, got in zip(BUDGETS, results[: len(BUDGETS)], strict=True):
        assert_close(f"packed budget {budget}", got, want)
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s) - 1)
    mine = slice(starts[victim], starts[victim + 1])
    for budget, (rows, _), (rows_p, _) in zip(
        BUDGETS, results[: len(BUDGETS)], results[len(BUDGETS) :], strict=True
    ):
        others = torch.ones(rows.size(0), dtype=torch.bool)
        others[mine] = False
        moved = (rows_p[others] - rows[others]).abs().max().item()
        assert moved <= 1e-6, f"budget {budget}: a neighbour's logits moved by {moved} (attention leaked)"
        assert (rows_p[mine] - rows[mine]).abs().max().item() > 1e-2, "the perturbed sequence did not change"


@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_context_parallel_equals_reference(tp, pp, cp):
    hf = tiny_hf_model("qwen3", seed=2)
    seqs = packed_sequences(seed=5)
    (got,) = run_packed(tp, pp, cp, hf, [(seqs, 32)])
    assert_close(f"TP{tp}xPP{pp}xCP{cp}", got, hf_reference(hf, seqs))
