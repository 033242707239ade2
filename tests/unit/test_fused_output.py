"""The fused output layer (ops/fused_output.py) against today's path (materialised logits, then the same
kernels) and an independent float64 full-vocabulary reference: values and gradients for the hidden states
and the weight, with vocabulary padding, temperature, chunk boundaries, tied embeddings, the teacher's
logits mix, and what autograd keeps (never a [T, V] tensor).

TP2 with and without sequence parallelism: tests/dist/test_fused_output_tp.py. A whole SRPO step with
``performance.fused_output`` on vs off: tests/dist/test_fused_output_trainer.py.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.ops import OutputShard, append_tail, fused_output, token_stats
from tests.helpers.losses_reference import ref_entropy, ref_logp, ref_topk, rel_err

T, H, V, PAD, K, J = 29, 24, 61, 3, 5, 3  # V - PAD real ids; T not a multiple of the chunks below
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    w = (0.5 * torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, V - PAD, (T, J), generator=g)
    ids[0] = torch.tensor([V - PAD - 1, 0, V - PAD - 2])  # the last real ids, next to the padding
    wts = [torch.randn(s, generator=g, dtype=torch.float64) for s in [(T, J), (T, K), (T,), (T, K + 1)]]
    pad = torch.zeros(V, dtype=torch.bool)
    pad[V - PAD :] = True
    return h, w, ids, wts, pad


def _objective(stats, wts):
    """Σ weights · (log p at ids, top-k log-probs, entropy, top-k + tail): every differentiable output."""
    w_ids, w_top, w_h, w_tail = wts
    return (
        (stats.logp.double() * w_ids).sum()
        + (stats.topk_logp.double() * w_top).sum()
        + (stats.entropy.double() * w_h).sum()
        + (append_tail(stats.topk_logp).double() * w_tail).sum()
    )


def _run(make_logits, h, w, ids, wts, temperature, chunk):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    stats = token_stats(
        make_logits(hh, ww), ids, k=K, with_entropy=True, temperature=temperature, chunk_tokens=chunk
    )
    _objective(stats, wts).backward()
    return stats, hh.grad, ww.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 4, 3])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("block", [None, 8], ids=["one-block", "blocks-of-8"])
def test_fused_equals_todays_path_and_the_float64_reference(
    monkeypatch, dtype, temperature, chunk, padded, block
):
    """``blocks-of-8``: GEMM blocks of at least 8 rows (``MIN_CHUNK_ROWS_CPU``; 9 with chunks of 3), so the
    T = 29 rows span several blocks and a partial last one; the default block holds them all."""
    if block is not None:
        monkeypatch.setattr(fused_output, "MIN_CHUNK_ROWS_CPU", block)
    h, w, ids, wts, pad = _inputs(dtype)
    if not padded:
        pad = torch.zeros_like(pad)
    fill = torch.finfo(dtype).min / 4
    fused_of = lambda ws: _run(lambda a, b: OutputShard(a, b, pad), h, w, ids, ws, temperature, chunk)  # noqa: E731
    today_of = lambda ws: _run(  # noqa: E731
        lambda a, b: (a @ b.T).masked_fill(pad, fill), h, w, ids, ws, temperature, chunk
    )
    # In fp32 without the tail term: its gradient 1/(1 − Σ_K p) amplifies any rounding (the GEMM's rows
    # blocked differently, the inputs') when the top-K hold nearly all the mass; append_tail runs after
    # either path, and fp64 keeps the term.
    if dtype == torch.float32:
        wts = [*wts[:3], torch.zeros_like(wts[3])]
    fused, today = fused_of(wts), today_of(wts)
    for a, b in zip(fused[1:], today[1:], strict=True):
        assert rel_err(a, b) < TOL[dtype]
    # the reference: float64, the real vocabulary only (padded ids do not exist there)
    real = V - PAD if padded else V
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    z = hr @ wr[:real].T
    r_top, r_ids = ref_topk(z, K, temperature)
    r_lp, r_h = ref_logp(z, ids, temperature), ref_entropy(z, temperature)
    lse_tail = torch.log1p(-r_top.exp().sum(-1, keepdim=True).clamp_max(1 - 1e-30))
    obj = (
        (r_lp * wts[0]).sum()
        + (r_top * wts[1]).sum()
        + (r_h * wts[2]).sum()
        + (torch.cat([r_top, lse_tail], -1) * wts[3]).sum()
    )
    obj.backward()
    tol = TOL[dtype]
    for name, (stats, gh, gw) in {"fused": fused, "today": today}.items():
        assert torch.equal(stats.topk_ids, r_ids), name
        assert rel_err(stats.logp, r_lp) < tol, name
        assert rel_err(stats.topk_logp, r_top) < tol, name
        assert rel_err(stats.entropy, r_h) < tol, name
        assert rel_err(gh, hr.grad) < tol, name
        assert rel_err(gw, wr.grad) < tol, name
        assert gh.dtype == dtype and gw.dtype == dtype
    if padded:
        assert fused[2][V - PAD :].abs().max() == 0  # padded vocabulary rows get no gradient


def test_tied_embedding_keeps_one_weight_with_both_gradients():
    """The output weight is the embedding's parameter: the lookup's and the output layer's gradients add."""
    h0, w, ids, wts, pad = _inputs(torch.float64)
    tokens = torch.randint(0, V - PAD, (T,), generator=torch.Generator().manual_seed(3))
    mix = torch.randn(H, H, generator=torch.Generator().manual_seed(4), dtype=torch.float64) / H**0.5

    def grads(fused: bool):
        emb = torch.nn.Embedding(V, H, dtype=torch.float64)
        with torch.no_grad():
            emb.weight.copy_(w)
        hidden = torch.tanh(emb(tokens) @ mix) + h0
        src = (
            OutputShard(hidden, emb.weight, pad)
            if fused
            else (hidden @ emb.weight.T).masked_fill(pad, -1e300)
        )
        _objective(token_stats(src, ids, k=K, with_entropy=True), wts).backward()
        return emb.weight.grad

    g_fused, g_today = grads(True), grads(False)
    assert rel_err(g_fused, g_today) < 1e-12
    # both uses reach the one parameter: an untied output copy would leave the lookup's rows alone
    looked_up = torch.zeros(V, dtype=torch.bool)
    looked_up[tokens] = True
    assert g_fused[looked_up].abs().sum() > 0 and g_fused[~looked_up & ~pad].abs().sum() > 0


def test_the_teacher_mix_equals_mixed_logits_and_is_forward_only():
    h, w, ids, _, pad = _inputs(torch.float64)
    h2, w2, *_ = _inputs(torch.float64, seed=5)
    a = 0.3
    mixed = OutputShard(h, w, pad, mix=(a, OutputShard(h2, w2, pad)))
    fill = torch.finfo(torch.float64).min / 4
    z = (1 - a) * (h @ w.T).masked_fill(pad, fill) + a * (h2 @ w2.T).masked_fill(pad, fill)
    with torch.no_grad():
        got = token_stats(mixed, ids, k=K, with_entropy=True, temperature=0.8, chunk_tokens=4)
        want = token_stats(z, ids, k=K, with_entropy=True, temperature=0.8, chunk_tokens=4)
    for g, x in zip(got, want, strict=True):
        assert torch.equal(g, x) if g.dtype == torch.int64 else rel_err(g, x) < 1e-12
    with pytest.raises(ValueError, match="forward-only"):
        token_stats(OutputShard(h.requires_grad_(), w, pad, mix=(a, OutputShard(h2, w2, pad))), ids)


def test_autograd_keeps_no_logits_sized_tensor():
    """What the fused forward saves for backward: the inputs and [T] statistics, never [T, V]; today's path
    saves the logits (the check can fail)."""
    h, w, ids, _, pad = _inputs(torch.float32)

    def saved_numels(fused: bool) -> list[int]:
        sizes: list[int] = []
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            src = OutputShard(hh, ww, pad) if fused else hh @ ww.T
            token_stats(src, ids, k=K, with_entropy=True)
        return sizes

    assert max(saved_numels(True)) < T * V
    assert max(saved_numels(False)) >= T * V


def test_a_hidden_size_mismatch_is_one_clear_error():
    h, w, *_ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="hidden size"):
        OutputShard(h[:, :-1], w)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "scoring"])
def test_the_gemm_block_is_freed_before_the_collectives_and_the_top_k_ordering(monkeypatch, grad):
    """The forward's [block, V/P] GEMM buffer is dead once the last chunk is scored: by the time the kernel
    reduces its statistics over TP and orders the top-k candidates it is gone (at TP2 holding it there made
    the extra memory 0.103-0.107 of a logits shard, over the 0.1 bound; tools/bench_fused_output.py)."""
    import weakref

    from srpo_megatron.ops import fused_output as fo
    from srpo_megatron.ops import vocab_parallel as vp

    h, w, ids, _, pad = _inputs(torch.float32)
    blocks: list[weakref.ref] = []
    alive_at_ordering: list[bool] = []
    chunk, order = fo._HiddenSource.chunk, vp._order_candidates

    def tracking_chunk(self, *args):
        out = chunk(self, *args)
        if self._buf is not None and (not blocks or blocks[-1]() is not self._buf):
            blocks.append(weakref.ref(self._buf))
        return out

    def tracking_order(*args):
        alive_at_ordering.append(any(ref() is not None for ref in blocks))
        return order(*args)

    monkeypatch.setattr(fo._HiddenSource, "chunk", tracking_chunk)
    monkeypatch.setattr(vp, "_order_candidates", tracking_order)
    monkeypatch.setattr(fo, "MIN_CHUNK_ROWS_CPU", 8)  # several blocks
    hh, ww = h.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        token_stats(OutputShard(hh, ww, pad), ids, k=K, with_entropy=True, chunk_tokens=4)
    assert blocks and alive_at_ordering == [False]
