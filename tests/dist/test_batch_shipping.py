"""``trainer/batch_shipping.py``: every rank gets rank 0's whole rollout batch, and an MoE batch's routed
experts only on the ranks whose DP share holds the sample (world 4 as TP2 × DP2, two mini-batches).

Checked per rank: the same samples in the same order, routed experts bit-equal to rank 0's for its share,
None for every other sample (and a sample the engine reported none for stays None); a dense batch takes
no scatter. Planted: the previous whole-batch broadcast, which every rank's "only my share" check catches.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed

DP_OF_RANK = [0, 0, 1, 1]  # TP2 × DP2: ranks 0, 1 hold DP replica 0
MINI_BATCHES = 2


def _batch(routed: bool):
    import torch

    from srpo_megatron.trainer.rollouts import RolloutBatch, Sample

    samples = []
    for i in range(8):
        s = Sample(i // 4, i % 4, [1, 2, i], [3, 4], [-1.0, -1.0])
        if routed and i != 5:  # the engine reported nothing for sample 5
            s.routed_experts = torch.full((4, 3, 2), i, dtype=torch.uint8)
        samples.append(s)
    return RolloutBatch(samples, {"reward/mean": 0.5})


def _worker(rank, world, routed, planted):
    import torch
    import torch.distributed as dist

    from srpo_megatron.trainer.batch_shipping import ship_batch
    from srpo_megatron.trainer.batches import rank_share

    full = lambda i: torch.full((4, 3, 2), i, dtype=torch.uint8)  # noqa: E731 - what rank 0 sent
    batch = _batch(routed) if rank == 0 else None
    if planted:  # the whole batch, routed experts included, to every rank
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        got = box[0]
    else:
        got = ship_batch(batch, dp_rank=DP_OF_RANK[rank], dp_size=2, mini_batches=MINI_BATCHES)
    mine = {id(s) for s in rank_share(got.samples, MINI_BATCHES, 2, DP_OF_RANK[rank])}
    return {
        "prompts": [s.prompt_ids for s in got.samples],
        "metrics": got.metrics,
        "mine": [id(s) in mine for s in got.samples],
        "routed": [None if s.routed_experts is None else str(s.routed_experts.dtype) for s in got.samples],
        "equal": all(
            s.routed_experts is None or torch.equal(s.routed_experts, full(i))
            for i, s in enumerate(got.samples)
        ),
    }


@pytest.mark.parametrize("planted", [False, True], ids=["ship_batch", "planted-broadcast"])
def test_routed_experts_reach_only_their_dp_share(planted):
    out = run_distributed(_worker, 4, True, planted, timeout=120)
    want = [[1, 2, i] for i in range(8)]
    only_mine = []
    for r in out:
        assert r["prompts"] == want and r["metrics"] == {"reward/mean": 0.5} and r["equal"]
        expected = [(i != 5 and mine) for i, mine in enumerate(r["mine"])]
        only_mine.append([x is not None for x in r["routed"]] == expected)
        assert all(x in (None, "torch.uint8") for x in r["routed"])
    assert sum(sum(r["mine"]) for r in out) == 16  # each sample in one DP share, held by its 2 TP ranks
    if planted:
        assert not any(only_mine), "the whole-batch broadcast gives every rank every sample's experts"
    else:
        assert all(only_mine)


def test_a_dense_batch_is_broadcast_whole():
    for r in run_distributed(_worker, 4, False, False, timeout=120):
        assert r["prompts"] == [[1, 2, i] for i in range(8)] and all(x is None for x in r["routed"])
