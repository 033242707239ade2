"""MoE weight sync: experts are gathered over EP and ETP in bounded buckets and arrive under the hub's
per-expert names, bit-exact; the transformers engine (fused experts in memory) installs them and then
gives the source model's logits exactly.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_moe_model
from tests.helpers.moe import batches_for, export_worker, hf_file_state

pytestmark = pytest.mark.moe

BUCKET_BYTES = 40_000  # a few expert tensors (one is 32*64*4 = 8 KiB; a gate/up pair 16 KiB)


@pytest.mark.parametrize("layout", [(1, 1, 2, 1), (2, 1, 2, 2)], ids=["ep2", "tp2ep2etp2"])
def test_expert_sync_is_bit_exact_bounded_and_installs_in_the_fused_engine(layout):
    from srpo_megatron.rollout.hf_engine import HFEngine

    tp, pp, ep, etp = layout
    source = tiny_moe_model(seed=4)
    state = hf_file_state(source)
    world = max(tp, ep * etp) * pp
    results = run_distributed(
        export_worker, world, layout, source.config.to_dict(), state, BUCKET_BYTES, timeout=600
    )
    received: dict[str, torch.Tensor] = {}
    for buckets, largest, _ in results:
        for bucket in buckets:
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= max(BUCKET_BYTES, largest), f"bucket of {size} bytes over the bound"
            for name, tensor in bucket:
                assert name not in received, f"{name} sent twice"
                received[name] = tensor
    assert sorted(received) == sorted(state)
    for name, want in state.items():
        assert torch.equal(received[name], want), name
    # One fetch gathers one local expert index from every EP rank: ep expert fc1 tensors, not a layer's.
    fc1_bytes = 2 * 32 * 64 * 4
    assert max(r[2] for r in results) == ep * fc1_bytes

    engine_model = tiny_moe_model(seed=99)  # different weights, same fused in-memory layout
    engine = HFEngine(engine_model, initial_version=1)
    engine.update_weights(received.items(), version=2)
    ids = batches_for(3)[0]
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, source(ids).logits)
    assert engine.weight_version == 2
