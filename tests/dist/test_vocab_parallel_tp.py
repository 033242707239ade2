"""The vocab-parallel ops at TP2 and TP4 over gloo equal the float64 full-vocabulary reference.

Each rank holds one vocabulary shard; outputs must be replicated and exact, and the gradient of each
shard must be that shard's slice of the full-vocabulary gradient. Covers ids owned by other shards,
top-k ties within and across shards, k larger than a shard, temperature, fp32 and fp64.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from srpo_megatron.ops import entropy, log_probs, token_stats, top_k
from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.losses_reference import ref_entropy, ref_logp, ref_topk, rel_err
from tests.helpers.losses_scenario import vocab_shard

V = 96
TAU = 0.8


def _data():
    gen = torch.Generator().manual_seed(11)
    x = 3.0 * torch.randn(12, V, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (12, 5), generator=gen)
    ids[0] = torch.tensor([V - 1, V - 2, V - 3, 0, 1])  # ids spread over the first and last shards
    ties = torch.randint(0, 3, (6, V), generator=gen).double()  # many ties, straddling the k-th
    ties[0] = 0.0
    ties[0, [5, V // 2 + 1, V - 4]] = 1.0  # a three-way tie for the maximum on different shards
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(12, 5), (12,), (12, 30)]]
    return x, ids, ties, weights


def digest(t):
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _ops_worker(rank, world):
    group = dist.group.WORLD
    x, ids, ties, (w_ids, w_h, w_top) = _data()
    out = {}
    for name, dtype in (("f64", torch.float64), ("f32", torch.float32)):
        shard = vocab_shard(x, rank, world).to(dtype)
        before = digest(shard)
        xs = shard.clone().requires_grad_()
        lp = log_probs(xs, ids, group=group, temperature=TAU, chunk_tokens=5)
        h = entropy(xs, group=group, temperature=TAU)
        tv, ti = top_k(xs, 30, group=group, temperature=TAU)  # 30 > V/4: spans several shards
        obj = (lp.double() * w_ids).sum() + (h.double() * w_h).sum() + (tv.double() * w_top).sum()
        obj.backward()
        fused = token_stats(shard, ids, k=3, with_entropy=True, group=group, temperature=TAU)
        out[name] = dict(lp=lp.detach(), h=h.detach(), tv=tv.detach(), ti=ti, grad=xs.grad, fused=fused)
        out[name]["unchanged"] = digest(shard) == before
    tie_shard = vocab_shard(ties, rank, world)
    out["ties"] = top_k(tie_shard, 7, group=group, chunk_tokens=4)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ops_tp_equal_float64_reference(world):
    results = run_distributed(_ops_worker, world, timeout=180)
    x, ids, ties, (w_ids, w_h, w_top) = _data()
    xr = x.clone().requires_grad_()
    r_lp, r_h = ref_logp(xr, ids, TAU), ref_entropy(xr, TAU)
    r_tv, r_ti = ref_topk(xr, 30, TAU)
    ((r_lp * w_ids).sum() + (r_h * w_h).sum() + (r_tv * w_top).sum()).backward()
    r_tie_v, r_tie_i = ref_topk(ties, 7)
    assert r_tie_i[0, :3].tolist() == [5, V // 2 + 1, V - 4]
    for name, tol in (("f64", 1e-6), ("f32", 1e-4)):
        grad = torch.cat([res[name]["grad"] for res in results], dim=-1)
        assert rel_err(grad, xr.grad) < tol, name
        for rank, res in enumerate(results):
            r = res[name]
            assert r["unchanged"], (name, rank)
            assert rel_err(r["lp"], r_lp) < tol and rel_err(r["h"], r_h) < tol, (name, rank)
            assert torch.equal(r["ti"], r_ti) and rel_err(r["tv"], r_tv) < tol, (name, rank)
            f = r["fused"]
            assert rel_err(f.logp, r_lp) < tol and rel_err(f.entropy, r_h) < tol
            assert torch.equal(f.topk_ids, r_ti[:, :3]) and rel_err(f.topk_logp, r_tv[:, :3]) < tol
    for rank, res in enumerate(results):
        tie_v, tie_i = res["ties"]
        assert torch.equal(tie_i, r_tie_i), rank
        assert rel_err(tie_v, r_tie_v) < 1e-12, rank
