"""tools/bench_demo_step.py's reference batches are the trainer's: the same right-padded width (the whole
batch's longest sequence rounded up to 8), the same micro-batch split, and spans whose targets are exactly
each sample's response tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_demo_step", REPO / "tools" / "bench_demo_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_batches_match_the_trainers_padding_and_response_rows():
    from srpo_megatron.trainer.microbatches.batches import micro_batches_for, student_sequences
    from srpo_megatron.trainer.step_types import Sample

    samples = [Sample(0, m, list(range(1, 4 + m)), [50 + m] * (2 + m), [-1.0] * (2 + m)) for m in range(5)]
    seqs = student_sequences(samples)
    batches = _bench().padded_batches(seqs, 2)
    trainer = micro_batches_for(seqs, 2, 0, 1, "cpu")
    assert [len(rows) for rows, _ in batches] == [2, 2, 1]
    assert {len(r) for rows, _ in batches for r in rows} == {trainer[0].tokens.shape[1]}
    flat = [(row, span) for rows, spans in batches for row, span in zip(rows, spans, strict=True)]
    for (row, (first, n)), s in zip(flat, samples, strict=True):
        assert row[first + 1 : first + 1 + n] == s.response_ids  # the rows' targets: the response
