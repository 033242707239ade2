"""Unsharded checks of the vocab-parallel ops against float64 full-softmax references (values + grads).

The same ops at TP2/TP4 over gloo are in tests/dist/test_vocab_parallel_tp.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from srpo_megatron.ops import append_tail, entropy, log_probs, token_stats, top_k
from tests.helpers.losses_reference import (
    ref_bucket_probs,
    ref_entropy,
    ref_log_softmax,
    ref_logp,
    ref_topk,
    rel_err,
)

TOL = {torch.float64: 1e-6, torch.float32: 1e-4}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _logits(shape, dtype, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 3])
def test_log_probs_entropy_values_and_grads(dtype, temperature, chunk):
    x = _logits((4, 5, 97), dtype)
    ids1 = torch.randint(0, 97, (4, 5), generator=torch.Generator().manual_seed(1))
    idsk = torch.randint(0, 97, (4, 5, 6), generator=torch.Generator().manual_seed(2))
    idsk[0, 0, :3] = 7  # repeated ids in one row: their gradients must add up
    w1, wk, wh = (torch.randn(s, dtype=torch.float64) for s in [(4, 5), (4, 5, 6), (4, 5)])
    before = digest(x)

    xo = x.clone().requires_grad_()
    lp1 = log_probs(xo, ids1, temperature=temperature, chunk_tokens=chunk)
    lpk = log_probs(xo, idsk, temperature=temperature, chunk_tokens=chunk)
    h = entropy(xo, temperature=temperature, chunk_tokens=chunk)
    assert lp1.shape == (4, 5) and lpk.shape == (4, 5, 6) and h.shape == (4, 5)
    obj = (lp1.double() * w1).sum() + (lpk.double() * wk).sum() + (h.double() * wh).sum()
    (g,) = torch.autograd.grad(obj, xo)

    xr = x.double().requires_grad_()
    r1, rk, rh = (
        ref_logp(xr, ids1, temperature),
        ref_logp(xr, idsk, temperature),
        ref_entropy(xr, temperature),
    )
    (gr,) = torch.autograd.grad((r1 * w1).sum() + (rk * wk).sum() + (rh * wh).sum(), xr)

    tol = TOL[dtype]
    assert rel_err(lp1, r1) < tol and rel_err(lpk, rk) < tol and rel_err(h, rh) < tol
    assert g.dtype == dtype and rel_err(g, gr) < tol
    assert digest(x) == before


def test_bf16_computes_in_fp32_and_returns_bf16_grads():
    x = _logits((6, 64), torch.bfloat16)
    ids = torch.arange(6) * 5
    xo = x.clone().requires_grad_()
    lp = log_probs(xo, ids)
    assert lp.dtype == torch.float32  # computed and returned in fp32
    (g,) = torch.autograd.grad(lp.sum() + entropy(xo).sum(), xo)
    xr = x.double().requires_grad_()
    (gr,) = torch.autograd.grad(ref_logp(xr, ids).sum() + ref_entropy(xr).sum(), xr)
    assert rel_err(lp, ref_logp(x.double(), ids)) < 1e-5  # exact fp32 math on the bf16 values
    assert g.dtype == torch.bfloat16 and rel_err(g, gr) < 1e-2  # only the final bf16 rounding


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_top_k_values_ids_and_grads(dtype):
    x = _logits((7, 50), dtype, seed=3)
    before = digest(x)
    xo = x.clone().requires_grad_()
    v, i = top_k(xo, 5, temperature=0.9)
    rv, ri = ref_topk(x.double(), 5, 0.9)
    assert torch.equal(i, ri)
    assert rel_err(v, rv) < TOL[dtype]
    wt = torch.randn(7, 5, dtype=torch.float64)
    (g,) = torch.autograd.grad((v.double() * wt).sum(), xo)
    xr = x.double().requires_grad_()
    (gr,) = torch.autograd.grad((ref_logp(xr, ri, 0.9) * wt).sum(), xr)
    assert rel_err(g, gr) < TOL[dtype]
    assert digest(x) == before


def test_top_k_ties_prefer_lower_ids():
    # Integer logits in a small range: many exact ties, also straddling the k-th position.
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 4, (9, 40), generator=gen).double()
    x[0] = 1.0  # a row that is one big tie
    v, i = top_k(x, 6, chunk_tokens=2)
    rv, ri = ref_topk(x, 6)
    assert torch.equal(i, ri)
    assert torch.equal(i[0], torch.arange(6))
    assert rel_err(v, rv) < 1e-12


def test_token_stats_fused_matches_separate_ops_and_topk_rows():
    x = _logits((10, 80), torch.float64, seed=5)
    ids = torch.randint(0, 80, (10, 3), generator=torch.Generator().manual_seed(6))
    rows = torch.tensor([True, False] * 5)
    s = token_stats(x, ids, k=4, topk_rows=rows, with_entropy=True, chunk_tokens=4)
    rv, ri = ref_topk(x, 4)
    assert rel_err(s.logp, ref_logp(x, ids)) < 1e-12
    assert rel_err(s.entropy, ref_entropy(x)) < 1e-12
    assert torch.equal(s.topk_ids[rows], ri[rows]) and bool((s.topk_ids[~rows] == 0).all())
    assert rel_err(s.topk_logp[rows], rv[rows]) < 1e-12 and bool(torch.isinf(s.topk_logp[~rows]).all())


def test_append_tail_is_the_remaining_mass():
    x = _logits((5, 30), torch.float64, seed=7)
    v, i = top_k(x, 4)
    buckets = append_tail(v)
    ref = ref_bucket_probs(x, i).log()
    assert buckets.shape == (5, 5) and rel_err(buckets, ref) < 1e-10
    assert rel_err(torch.logsumexp(buckets, -1).exp(), torch.ones(5, dtype=torch.float64)) < 1e-12


def test_inputs_unchanged_fp32_temperature_one():
    # fp32 with τ = 1 is the case where the kernel works on the input storage directly.
    x = _logits((8, 33), torch.float32, seed=8).requires_grad_()
    ids = torch.randint(0, 33, (8, 4), generator=torch.Generator().manual_seed(9))
    before_x, before_ids = digest(x), digest(ids)
    s = token_stats(x, ids, k=3, with_entropy=True)
    (s.logp.sum() + s.topk_logp.sum() + s.entropy.sum()).backward()
    assert digest(x) == before_x and digest(ids) == before_ids
    ref = ref_log_softmax(x.detach())
    assert rel_err(s.logp, ref.gather(1, ids)) < 1e-5


def test_bad_ids_and_k_are_rejected():
    x = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="ids must lie"):
        log_probs(x, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="top-k"):
        top_k(x, 11)
