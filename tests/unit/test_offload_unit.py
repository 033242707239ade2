"""The offload's storage round trip and its config guard, without megatron (fast).

The megatron-path tests (DDP buffers, distributed optimizer, EMA teacher, planner figures) are in
tests/dist/test_offload.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.trainer.state import offload as off


def _policy():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    main = [p.detach().clone().double().float().requires_grad_() for p in model.parameters()]
    adam = torch.optim.Adam(main, lr=0.1)
    for p in main:
        p.grad = torch.randn_like(p)
    adam.step()
    optimizer = SimpleNamespace(optimizer=adam)
    return SimpleNamespace(model=model, optimizer=optimizer, teacher=None, device=torch.device("cpu"))


def test_round_trip_is_bit_exact_and_frees_the_storages():
    policy = _policy()
    o = off.Offloader(policy, during_rollout=True, teacher=False)
    before = [t.clone() for t in o.tensors(off.OPTIMIZER)]
    kept = [p.detach().clone() for p in policy.model.parameters()]
    full = o.resident_bytes()
    assert full[off.OPTIMIZER] == 3 * 4 * sum(p.numel() for p in policy.model.parameters())
    o.before_rollouts()
    during = o.resident_bytes()
    assert during[off.OPTIMIZER] == 0 and during[off.POLICY] == full[off.POLICY]
    assert all(t.untyped_storage().nbytes() == 0 for t, _, _ in o.away[off.OPTIMIZER].entries)
    metrics = o.after_rollouts()
    assert metrics["memory/rollout_resident_bytes"] == full[off.POLICY]
    after = o.tensors(off.OPTIMIZER)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(kept, policy.model.parameters(), strict=True))
    assert o.resident_bytes() == full


def test_the_policy_weights_never_leave():
    policy = _policy()
    o = off.Offloader(policy, during_rollout=True, teacher=False)
    o.offload([off.POLICY])
    assert off.POLICY not in o.away  # the weight sync reads them during rollouts


def test_sharded_teacher_needs_the_distributed_optimizer():
    from srpo_megatron.config import ParallelConfig

    with pytest.raises(ValueError, match=r"parallel\.distributed_optimizer=true"):
        ParallelConfig(teacher_fp32="sharded")
    assert ParallelConfig(teacher_fp32="sharded", distributed_optimizer=True).teacher_fp32 == "sharded"
