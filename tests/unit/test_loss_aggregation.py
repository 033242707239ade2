"""``loss.aggregation``: seq_mean_token_mean against a float64 formula written from scratch, invariant to
micro-batch splits (samples cut in the middle included); token_mean unchanged bit for bit.

DP2 and TP2 invariance are in tests/dist/test_losses_dp.py; packing in tests/dist/test_packing_trainer.py.
Each planted variant below (a sample's length or the sequence count taken per micro-batch, not over the
whole batch) is run through the same comparison and must miss the reference.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch

from srpo_megatron.config import LossConfig
from srpo_megatron.losses import (
    Normalizers,
    TokenBatch,
    global_normalizers,
    routed_loss,
    sequence_weights,
)
from srpo_megatron.losses.aggregation import aggregate
from tests.helpers.losses_reference import ref_routed_loss, rel_err
from tests.helpers.losses_scenario import build_batch, make_problem, ref_cfg, sample_offsets

MODES = ["srpo", "grpo", "sdpo", "srpo_no_dw", "sdpo_incorrect_only", "sdpo_correct_only", "advantage_mix"]
SEQ = "seq_mean_token_mean"


def _digest(*ts: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in ts:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _cfg(mode="srpo", aggregation=SEQ, **kw):
    return LossConfig(
        mode=mode, top_k=4, temperature=0.9, kl_coef=0.02, entropy_coef=0.01, aggregation=aggregation, **kw
    )


# ------------------------------------------------- the aggregation alone, on random per-token losses


def _random_case(seed: int):
    """Per-token losses ℓ [T] (float64, differentiable), a mask with a few invalid rows (one sample fully
    invalid), and the sample offsets."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (11,), generator=gen).tolist()
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    t = offsets[-1]
    mask = torch.rand(t, generator=gen) > 0.2
    mask[offsets[3] : offsets[4]] = False  # a sample with no valid token: out of N_seq
    loss = torch.randn(t, generator=gen, dtype=torch.float64).requires_grad_()
    return loss, mask, offsets


def _from_scratch(loss: torch.Tensor, mask: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """(1/N_seq) Σ_i (1/|y_i|) Σ_t ℓ_it over the valid tokens, N_seq = samples with a valid token."""
    per_seq = []
    for a, b in itertools.pairwise(offsets):
        valid = [r for r in range(a, b) if bool(mask[r])]
        if valid:
            per_seq.append(sum(loss[r] for r in valid) / len(valid))
    return sum(per_seq) / len(per_seq)


def _token_batch(mask: torch.Tensor, seq_weight: torch.Tensor | None) -> TokenBatch:
    t = mask.shape[0]
    z = torch.zeros(t, dtype=torch.float64)
    return TokenBatch(
        response_ids=torch.zeros(t, dtype=torch.long),
        mask=mask,
        advantages=z,
        grpo=mask.clone(),
        sdpo=torch.zeros(t, dtype=torch.bool),
        old_logp=z,
        seq_weight=seq_weight,
    )


def _cuts(t: int, n: int, gen: torch.Generator) -> list[int]:
    inner = sorted(torch.randperm(t - 1, generator=gen)[: n - 1].add(1).tolist())
    return [0, *inner, t]


def _ours(loss, mask, offsets, cuts):
    batch = _token_batch(mask, sequence_weights(mask, offsets))
    micro = [batch.slice(a, b) for a, b in itertools.pairwise(cuts)]
    norm = global_normalizers(micro, beta=1.0)
    pairs = zip(itertools.pairwise(cuts), micro, strict=True)
    return sum(aggregate(loss[a:b], mb, norm, SEQ) for (a, b), mb in pairs)


def _planted_length_per_micro_batch(loss, mask, offsets, cuts):
    """Bug: each sample's |y_i| counted within the micro-batch (a split sample divides by its part)."""
    batch = _token_batch(mask, None)
    out = loss.new_zeros(())
    pieces = []
    for a, b in itertools.pairwise(cuts):
        local = [a] + [o for o in offsets if a < o < b] + [b]
        w = sequence_weights(mask[a:b], [o - a for o in local])
        pieces.append((a, b, batch.slice(a, b), w))
    n_seq = round(sum(float(w[m.mask].sum()) for _, _, m, w in pieces))
    for a, b, mb, w in pieces:
        mb.seq_weight = w
        out = out + aggregate(loss[a:b], mb, Normalizers(0.0, 0.0, 0.0, float(n_seq)), SEQ)
    return out


def _planted_count_per_micro_batch(loss, mask, offsets, cuts):
    """Bug: each micro-batch divides by its own sequence count, then micro-batches are averaged."""
    batch = _token_batch(mask, sequence_weights(mask, offsets))
    parts = []
    for a, b in itertools.pairwise(cuts):
        mb = batch.slice(a, b)
        own = global_normalizers([mb], beta=1.0)
        if own.num_seqs > 0:
            parts.append(aggregate(loss[a:b], mb, own, SEQ))
    return sum(parts) / len(parts)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_micro", [1, 3, 6])
def test_seq_mean_token_mean_equals_the_formula_for_any_micro_batch_split(seed, n_micro):
    loss, mask, offsets = _random_case(seed)
    ref = _from_scratch(loss, mask, offsets)
    (ref_g,) = torch.autograd.grad(ref, loss)
    cuts = _cuts(loss.shape[0], n_micro, torch.Generator().manual_seed(100 + seed))
    got = _ours(loss, mask, offsets, cuts)
    (g,) = torch.autograd.grad(got, loss)
    assert abs(float(got) - float(ref)) <= 1e-14 * abs(float(ref))
    assert rel_err(g, ref_g) < 1e-14
    if n_micro > 1:  # the planted per-micro-batch variants miss the same reference
        for planted in (_planted_length_per_micro_batch, _planted_count_per_micro_batch):
            wrong = planted(loss, mask, offsets, cuts)
            assert abs(float(wrong) - float(ref)) > 1e-6 * abs(float(ref)), planted.__name__


def test_sequence_weights_hand_worked():
    mask = torch.tensor([True, True, False, False, False, True])
    w = sequence_weights(mask, [0, 3, 5, 6])  # sample 0: 2 valid of 3 rows; sample 1: none; sample 2: 1
    assert w.dtype == torch.float64
    assert w.tolist() == [0.5, 0.5, 0.0, 0.0, 0.0, 1.0]
    norm = global_normalizers([_token_batch(mask, w)], beta=1.0)
    assert norm.num_seqs == 2.0 and norm.num_tokens == 3.0


# ------------------------------------------------- the routed objective, every branch


def _routed(prob, cfg, n_micro, dtype=torch.float64):
    x = prob.student.to(dtype)
    batch = build_batch(prob, cfg, x, prob.teacher.to(dtype), dtype=dtype)
    micro = batch.split(n_micro)
    norm = global_normalizers(micro, cfg.beta)
    total, grads, start = 0.0, [], 0
    for mb in micro:
        xm = x[start : start + len(mb)].clone().requires_grad_()
        start += len(mb)
        loss, _ = routed_loss(xm, mb, norm, cfg)
        (g,) = torch.autograd.grad(loss, xm)
        total += float(loss.detach())
        grads.append(g)
    return total, torch.cat(grads)


def _reference(prob, cfg):
    x = prob.student.clone().requires_grad_()
    loss = ref_routed_loss(
        x, prob.teacher, prob.rewards, prob.sample_of_token, prob.response_ids, prob.mask,
        prob.old_logp, prob.rollout_logp, ref_cfg(cfg), prob.ref_logp,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), g


@pytest.mark.parametrize("mode", MODES)
def test_routed_seq_mean_token_mean_matches_reference_every_mode(mode):
    prob = make_problem(seed=2)
    cfg = _cfg(mode)
    ref_loss, ref_g = _reference(prob, cfg)
    token_loss, _ = _reference(prob, _cfg(mode, "token_mean"))
    assert abs(ref_loss - token_loss) > 1e-3 * abs(token_loss), "the two aggregations coincide here"
    for n_micro in (1, 5):  # 5 micro-batches of equal rows cut samples in the middle
        loss, g = _routed(prob, cfg, n_micro)
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), n_micro
        assert rel_err(g, ref_g) < 1e-6, n_micro
    base, base_g = _routed(prob, cfg, 1)
    loss, g = _routed(prob, cfg, 5)
    assert abs(loss - base) <= 1e-12 * abs(base) and rel_err(g, base_g) < 1e-12


def test_rejected_tokens_leave_the_sample_length_and_a_fully_rejected_sample_leaves_n_seq():
    """A cleared mask (what ``apply_rejections`` does to MIS / stale tokens) before ``sequence_weights``:
    the reference drops those tokens from |y_i| and a sample with none left from N_seq."""
    prob = make_problem(seed=3)
    offsets = sample_offsets(prob)
    prob.mask[offsets[1] : offsets[2]] = False  # sample 1 fully rejected
    prob.mask[offsets[5]] = False  # sample 5 partly
    cfg = _cfg("srpo")
    ref_loss, ref_g = _reference(prob, cfg)
    loss, g = _routed(prob, cfg, 3)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and rel_err(g, ref_g) < 1e-6
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    n_samples = len(offsets) - 1
    assert global_normalizers([batch], cfg.beta).num_seqs == n_samples - 1


def test_fp32_seq_mean_within_1e4_of_reference():
    prob = make_problem(seed=2)
    cfg = _cfg("srpo")
    ref_loss, ref_g = _reference(prob, cfg)
    loss, g = _routed(prob, cfg, 2, dtype=torch.float32)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss) and rel_err(g.double(), ref_g) < 1e-4


@pytest.mark.parametrize("mode", ["srpo", "sdpo", "grpo"])
def test_token_mean_is_unchanged_bit_for_bit_by_a_seq_weight(mode):
    """token_mean ignores ``seq_weight``: the same batch with and without it gives identical bits."""
    prob = make_problem(seed=4)
    cfg = _cfg(mode, "token_mean")
    x = prob.student.float()
    batch = build_batch(prob, cfg, x, prob.teacher.float(), dtype=torch.float32)
    weighted = build_batch(prob, _cfg(mode), x, prob.teacher.float(), dtype=torch.float32)
    assert batch.seq_weight is None and weighted.seq_weight is not None
    out = []
    for b in (batch, weighted):
        norm = global_normalizers([b], cfg.beta)
        xm = x.clone().requires_grad_()
        loss, _ = routed_loss(xm, b, norm, cfg)
        (g,) = torch.autograd.grad(loss, xm)
        counts = torch.tensor([norm.num_tokens, norm.num_sdpo_tokens, norm.sum_raw_weights])
        out.append(_digest(loss, g, counts))
    assert out[0] == out[1]


def test_seq_mean_without_seq_weight_is_refused_with_the_fix():
    prob = make_problem(seed=2)
    batch = build_batch(prob, _cfg("srpo", "token_mean"), prob.student, prob.teacher)
    norm = global_normalizers([batch], 1.0)
    with pytest.raises(ValueError, match="sequence_weights"):
        routed_loss(prob.student, batch, norm, _cfg("srpo"))
