"""``trainer/collect/batch_shipping.py``: completions reach rank 0 only, and each rank receives exactly its DP share
of the routed batch, once (world 4 as TP2 × DP2, two mini-batches).

Checked per rank: the samples it received are ``batches.rank_share`` of rank 0's batch, in that order, with
their routed experts bit-equal to rank 0's (a sample the engine reported none for stays None), and the
whole batch's metrics; a dense batch is shipped the same way. Planted (through the real ``ship_shares``,
with ``share_payloads`` replaced): the whole batch to every rank (the earlier broadcast), and a rank's
share plus one sample of the other share; each rank's "exactly my share" check catches both.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed

DP_OF_RANK = [0, 0, 1, 1]  # TP2 × DP2: ranks 0, 1 hold DP replica 0
MINI_BATCHES = 2


def _batch(routed: bool):
    import torch

    from srpo_megatron.trainer.step_types import RolloutBatch, Sample

    samples = []
    for i in range(8):
        experts = torch.full((4, 3, 2), i, dtype=torch.uint8) if routed and i != 5 else None  # none for 5
        samples.append(Sample(i // 4, i % 4, [1, 2, i], [3, 4], [-1.0, -1.0], routed_experts=experts))
    return RolloutBatch(samples, {"reward/mean": 0.5})


def _plant(how: str) -> None:
    """Replace ``share_payloads`` in this rank process with a wrong one (rank 0 is the one that uses it)."""
    from srpo_megatron.trainer.collect import batch_shipping
    from srpo_megatron.trainer.step_types import RolloutBatch

    real = batch_shipping.share_payloads

    def whole(batch, dp_of_rank, mini_batches, dp_size):
        return [RolloutBatch(list(batch.samples), batch.metrics) for _ in dp_of_rank]

    def neighbour(batch, dp_of_rank, mini_batches, dp_size):  # one sample of the other share too
        out = real(batch, dp_of_rank, mini_batches, dp_size)
        other = real(batch, [1 - d for d in dp_of_rank], mini_batches, dp_size)
        return [RolloutBatch([*o.samples, x.samples[0]], o.metrics) for o, x in zip(out, other, strict=True)]

    batch_shipping.share_payloads = {"whole": whole, "neighbour": neighbour}[how]


def _worker(rank, world, routed, planted):
    import torch

    from srpo_megatron.trainer.collect.batch_shipping import ship_shares
    from srpo_megatron.trainer.microbatches.batches import rank_share

    if planted:
        _plant(planted)
    got = ship_shares(
        _batch(routed) if rank == 0 else None, dp_rank=DP_OF_RANK[rank], dp_size=2, mini_batches=MINI_BATCHES
    )
    want = rank_share(_batch(routed).samples, MINI_BATCHES, 2, DP_OF_RANK[rank])  # what rank 0 built
    key = lambda s: (s.group, s.member, s.prompt_ids, s.response_ids)  # noqa: E731
    return {
        "exactly_mine": [key(s) for s in got.samples] == [key(s) for s in want],
        "samples": len(got.samples),
        "metrics": got.metrics,
        "experts_equal": all(
            (s.routed_experts is None) == (w.routed_experts is None)
            and (s.routed_experts is None or torch.equal(s.routed_experts, w.routed_experts))
            for s, w in zip(got.samples, want, strict=False)  # lengths: exactly_mine
        ),
        "dtypes": sorted({str(s.routed_experts.dtype) for s in got.samples if s.routed_experts is not None}),
    }


@pytest.mark.parametrize("routed", [True, False], ids=["moe", "dense"])
def test_each_rank_receives_exactly_its_dp_share_once(routed):
    out = run_distributed(_worker, 4, routed, "", timeout=120)
    for r in out:
        assert r["exactly_mine"] and r["samples"] == 4 and r["experts_equal"]
        assert r["metrics"] == {"reward/mean": 0.5}, "every rank gets the whole batch's metrics"
        assert r["dtypes"] == (["torch.uint8"] if routed else [])


@pytest.mark.parametrize("planted", ["whole", "neighbour"])
def test_a_sample_outside_the_share_is_caught(planted):
    out = run_distributed(_worker, 4, True, planted, timeout=120)
    assert not any(r["exactly_mine"] for r in out), f"planted {planted}: every rank got a foreign sample"


def _gather_worker(rank, world):
    from srpo_megatron.trainer.collect.batch_shipping import broadcast_from_rank0, gather_to_rank0

    got = gather_to_rank0({"rank": rank} if rank % 2 == 0 else None)
    failures = broadcast_from_rank0([(1, "engine 1 failed")] if rank == 0 else None)
    return {"gathered": got, "failures": failures}


def test_completions_go_to_rank0_only_and_the_failure_list_to_everyone():
    out = run_distributed(_gather_worker, 4, timeout=120)
    assert out[0]["gathered"] == [{"rank": 0}, None, {"rank": 2}, None]
    assert all(r["gathered"] is None for r in out[1:]), "only rank 0 receives the engines' shares"
    assert all(r["failures"] == [(1, "engine 1 failed")] for r in out)
