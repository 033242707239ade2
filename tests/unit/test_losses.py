"""Losses against float64 naive references and hand-worked values; micro-batch invariance; config checks.

DP (1/2 ranks) and TP (2/4) invariance of the routed loss are in tests/dist/test_losses_dp.py.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from srpo_megatron.config import ConfigError, LossConfig, from_dict
from srpo_megatron.losses import (
    dynamic_weights,
    global_normalizers,
    grpo_token_loss,
    routed_loss,
    sdpo_token_loss,
    topk_divergence,
)
from srpo_megatron.ops import log_probs, top_k
from tests.helpers.losses_reference import (
    RefCfg,
    ref_bucket_probs,
    ref_divergence,
    ref_grpo_token,
    ref_routed_loss,
    rel_err,
)
from tests.helpers.losses_scenario import build_batch, make_problem, ref_cfg

MODES = ["srpo", "grpo", "sdpo", "srpo_no_dw", "sdpo_incorrect_only", "sdpo_correct_only", "advantage_mix"]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- GRPO


def test_grpo_hand_worked_clip_regimes():
    # ρ = 1.5, A = +1: clipped at 1.28 → loss −1.28 (no gradient). ρ = 0.5, A = +1: unclipped → −0.5.
    # ρ = 5, A = −1: PPO gives 5, dual clip caps at c·|A| = 3. ρ = 0.5, A = −1: clipped at 0.8 → 0.8.
    ratio = torch.tensor([1.5, 0.5, 5.0, 0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    logp = ratio.log().requires_grad_()
    loss, m = grpo_token_loss(logp, old, adv, None)
    assert torch.allclose(loss, torch.tensor([-1.28, -0.5, 3.0, 0.8], dtype=torch.float64), atol=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    # d(−ρA)/d log ρ = −ρA where unclipped; zero where clipped or dual-clipped.
    assert torch.allclose(g, torch.tensor([0.0, -0.5, 0.0, 0.0], dtype=torch.float64), atol=1e-12)
    assert m["clipped"].tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_grpo_log_ratio_100_gives_finite_loss_and_gradient(dual_clip):
    """fp32: exp(100) overflows; the ±20 clamp (verl's) keeps loss and gradient finite, and such a token's
    loss equals the one at log-ratio 20 (the ratio is constant beyond the clamp: no gradient through it)."""
    adv = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0])
    old = torch.zeros(5)
    logp = torch.tensor([100.0, 100.0, 100.0, -100.0, -100.0], requires_grad=True)
    loss, _ = grpo_token_loss(logp, old, adv, None, dual_clip=dual_clip)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(g).all()), (loss, g)
    at_bound = torch.tensor([20.0, 20.0, 20.0, -20.0, -20.0])
    edge, _ = grpo_token_loss(at_bound, old, adv, None, dual_clip=dual_clip)
    assert torch.equal(loss.detach(), edge)
    assert torch.equal(g, torch.zeros(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grpo_inside_the_clamp_is_bit_identical_to_the_unclamped_ratio(dtype):
    """Inside ±20 the clamp changes nothing: loss and gradient equal the plain exp(log π_θ − log π_old)."""
    gen = torch.Generator().manual_seed(5)
    t = 64
    logp = (torch.rand(t, generator=gen, dtype=torch.float64) * 39.0 - 19.5).to(dtype).requires_grad_()
    old = torch.zeros(t, dtype=dtype)
    adv = torch.randn(t, generator=gen, dtype=torch.float64).to(dtype)
    loss, _ = grpo_token_loss(logp, old, adv, None, tis_cap=None)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    ratio = (logp - old).exp()  # before the clamp
    plain = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.28) * adv)
    plain = torch.where(adv < 0, torch.minimum(plain, -3.0 * adv), plain)
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    assert torch.equal(loss.detach(), plain.detach()) and torch.equal(g, g_plain)


def test_sdpo_ratio_log_ratio_clamped():
    """SDPO's current/old ratio: log-ratio 100 is capped (finite), −100 floors at exp(−20) as SDPO's code."""
    p = torch.log_softmax(torch.randn(3, 4, dtype=torch.float64), -1).requires_grad_()
    q = torch.log_softmax(torch.randn(3, 4, dtype=torch.float64), -1)
    logp = torch.tensor([100.0, -100.0, 0.5], dtype=torch.float64)
    old = torch.zeros(3, dtype=torch.float64)
    loss, _ = sdpo_token_loss(p, q, logp, old, None)
    d = topk_divergence(p, q, 0.5, add_tail=False)
    expect = d * torch.tensor([2.0, math.exp(-20.0), math.exp(0.5)], dtype=torch.float64)
    assert torch.equal(loss, expect)
    (g,) = torch.autograd.grad(loss.sum(), p)
    assert bool(torch.isfinite(g).all())


def test_grpo_tis_cap_kl_entropy_against_reference():
    gen = torch.Generator().manual_seed(0)
    n = 64
    old = -3 * torch.rand(n, generator=gen, dtype=torch.float64)
    logp0 = old + 0.6 * torch.randn(n, generator=gen, dtype=torch.float64)
    rollout = old + 0.8 * torch.randn(n, generator=gen, dtype=torch.float64)
    ref = old + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    ent = torch.rand(n, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[:4] = -2.0
    logp0[:4] = old[:4] + 1.4  # ρ ≈ 4 > c: dual clip
    cfg = RefCfg(kl_coef=0.05, entropy_coef=0.01)
    logp = logp0.clone().requires_grad_()
    loss, _ = grpo_token_loss(
        logp, old, adv, rollout, ref_logp=ref, kl_coef=0.05, entropy=ent, entropy_coef=0.01
    )
    (g,) = torch.autograd.grad(loss.sum(), logp)
    lr = logp0.clone().requires_grad_()
    ref_loss = torch.stack(
        [ref_grpo_token(lr[t], old[t], float(adv[t]), rollout[t], cfg, ref[t], ent[t]) for t in range(n)]
    )
    (gr,) = torch.autograd.grad(ref_loss.sum(), lr)
    assert rel_err(loss, ref_loss) < 1e-12 and rel_err(g, gr) < 1e-12
    assert bool(((old - rollout).exp() > 2).any())  # the TIS cap was exercised


# ---------------------------------------------------------------- SDPO


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topk_divergence_matches_full_vocab_buckets(alpha, dtype):
    gen = torch.Generator().manual_seed(1)
    s0 = (2 * torch.randn(6, 40, generator=gen, dtype=torch.float64)).to(dtype)
    t0 = (s0.double() + torch.randn(6, 40, generator=gen, dtype=torch.float64)).to(dtype)
    before = digest(s0), digest(t0)
    s = s0.clone().requires_grad_()
    student_topk, ids = top_k(s, 5, temperature=0.8)
    teacher_topk = log_probs(t0, ids, temperature=0.8)
    d = topk_divergence(student_topk, teacher_topk, alpha)
    (g,) = torch.autograd.grad(d.sum(), s)
    sr = s0.double().requires_grad_()
    dr = ref_divergence(ref_bucket_probs(sr, ids, 0.8), ref_bucket_probs(t0.double(), ids, 0.8), alpha)
    (gr,) = torch.autograd.grad(dr.sum(), sr)
    tol = 1e-6 if dtype == torch.float64 else 1e-4
    assert rel_err(d, dr) < tol and rel_err(g, gr) < tol
    assert (digest(s0), digest(t0)) == before


def test_divergence_endpoints_are_the_named_kls():
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.2, 0.6]], dtype=torch.float64)
    fwd = sum(qi * math.log(qi / pi) for pi, qi in zip(p[0].tolist(), q[0].tolist(), strict=True))
    rev = sum(pi * math.log(pi / qi) for pi, qi in zip(p[0].tolist(), q[0].tolist(), strict=True))
    assert abs(float(topk_divergence(p.log(), q.log(), 0.0, add_tail=False)) - fwd) < 1e-14
    assert abs(float(topk_divergence(p.log(), q.log(), 1.0, add_tail=False)) - rev) < 1e-14


def test_sdpo_token_loss_scales_by_detached_ratio_cap_and_tis():
    p = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)).requires_grad_()
    q = torch.log(torch.tensor([[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]], dtype=torch.float64))
    logp = torch.tensor([math.log(3.0), 0.0], dtype=torch.float64)  # ratio 3 → capped at 2; ratio 1
    old = torch.zeros(2, dtype=torch.float64)
    rollout = torch.tensor([-0.5, 2.0], dtype=torch.float64)  # TIS weights min(e^0.5, 2), e^-2
    loss, _ = sdpo_token_loss(p, q, logp, old, rollout)
    d = topk_divergence(p, q, 0.5, add_tail=False)
    expect = d * torch.tensor([2.0 * math.exp(0.5), math.exp(-2.0)], dtype=torch.float64)
    assert rel_err(loss, expect) < 1e-14
    (g,) = torch.autograd.grad(loss.sum(), p)
    (ge,) = torch.autograd.grad(expect.sum(), p)
    assert rel_err(g, ge) < 1e-14


def test_dynamic_weights_hand_worked():
    h = torch.tensor([0.0, math.log(2.0), 5.0, math.log(4.0)], dtype=torch.float64)
    mask = torch.tensor([True, True, False, True])
    # w̃ = 1, 1/2, (masked), 1/4; mean over the mask 7/12.
    w = dynamic_weights(h, mask, beta=1.0)
    assert torch.allclose(w, torch.tensor([12 / 7, 6 / 7, 0.0, 3 / 7], dtype=torch.float64), atol=1e-14)
    # A global mean supplied by the caller replaces the local one.
    assert torch.allclose(
        dynamic_weights(h, mask, 1.0, mean_raw=0.5)[0], torch.tensor(2.0, dtype=torch.float64)
    )


# ---------------------------------------------------------------- routed objective


def _ours(prob, cfg, n_micro, dtype=torch.float64):
    x = prob.student.to(dtype)
    batch = build_batch(prob, cfg, x, prob.teacher.to(dtype), dtype=dtype)
    micro = batch.split(n_micro)
    norm = global_normalizers(micro, cfg.beta)
    xs = [p.clone().requires_grad_() for p in torch.tensor_split(x, _cuts(micro))]
    total, grads = 0.0, []
    for xm, mb in zip(xs, micro, strict=True):
        loss, _ = routed_loss(xm, mb, norm, cfg)
        (g,) = torch.autograd.grad(loss, xm)
        total += float(loss.detach())
        grads.append(g)
    return total, torch.cat(grads)


def _cuts(micro):
    out, acc = [], 0
    for m in micro[:-1]:
        acc += len(m)
        out.append(acc)
    return out


def _reference(prob, cfg, scope_of_token=None):
    x = prob.student.clone().requires_grad_()
    loss = ref_routed_loss(
        x,
        prob.teacher,
        prob.rewards,
        prob.sample_of_token,
        prob.response_ids,
        prob.mask,
        prob.old_logp,
        prob.rollout_logp,
        ref_cfg(cfg),
        prob.ref_logp,
        scope_of_token,
    )
    (g,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), g


@pytest.mark.parametrize("mode", MODES)
def test_routed_loss_matches_reference_every_mode(mode):
    cfg = LossConfig(
        mode=mode, top_k=4, temperature=0.9, kl_coef=0.02, entropy_coef=0.01, divergence_alpha=0.5
    )
    prob = make_problem(seed=2)
    loss, g = _ours(prob, cfg, 1)
    ref_loss, ref_g = _reference(prob, cfg)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert rel_err(g, ref_g) < 1e-6


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_routed_loss_reference_forward_and_reverse_kl(alpha):
    cfg = LossConfig(top_k=3, divergence_alpha=alpha, beta=0.5, std_normalize=True)
    prob = make_problem(seed=3)
    loss, g = _ours(prob, cfg, 2)
    ref_loss, ref_g = _reference(prob, cfg)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and rel_err(g, ref_g) < 1e-6


def test_routed_loss_fp32_within_1e4():
    cfg = LossConfig(top_k=4)
    prob = make_problem(seed=4)
    loss, g = _ours(prob, cfg, 2, dtype=torch.float32)
    ref_loss, ref_g = _reference(prob, cfg)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss) and rel_err(g, ref_g) < 1e-4


@pytest.mark.parametrize("mode", ["srpo", "advantage_mix"])
def test_routed_loss_micro_batch_invariance(mode):
    cfg = LossConfig(mode=mode, top_k=4)
    prob = make_problem(seed=5)
    loss1, g1 = _ours(prob, cfg, 1)
    for n in (2, 4):
        loss_n, g_n = _ours(prob, cfg, n)
        assert abs(loss_n - loss1) <= 1e-12 * abs(loss1)
        assert rel_err(g_n, g1) < 1e-12


def test_micro_batch_weight_scope_uses_each_micro_batch_mean():
    cfg = LossConfig(top_k=4, weight_scope="micro_batch")
    prob = make_problem(seed=6)
    loss, g = _ours(prob, cfg, 2)
    t = len(prob.sample_of_token)
    half = round(t / 2)
    ref_loss, ref_g = _reference(prob, cfg, scope_of_token=[0] * half + [1] * (t - half))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and rel_err(g, ref_g) < 1e-6
    batch_loss, _ = _ours(prob, LossConfig(top_k=4), 2)
    assert abs(batch_loss - loss) > 1e-6  # the scope matters, so the check above can fail


def test_routed_loss_leaves_inputs_unchanged():
    cfg = LossConfig(top_k=4, kl_coef=0.1, entropy_coef=0.01)
    prob = make_problem(seed=7)
    x = prob.student.float().requires_grad_()
    batch = build_batch(prob, cfg, x.detach(), prob.teacher.float(), dtype=torch.float32)
    fields = {k: digest(v) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    before = digest(x)
    loss, _ = routed_loss(x, batch, global_normalizers([batch], cfg.beta), cfg)
    loss.backward()
    assert digest(x) == before
    assert {k: digest(v) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)} == fields


# ---------------------------------------------------------------- config


def test_loss_config_defaults_are_the_papers():
    c = LossConfig()
    assert (c.eps_low, c.eps_high, c.dual_clip, c.tis_cap, c.kl_coef, c.entropy_coef) == (
        0.2,
        0.28,
        3.0,
        2.0,
        0,
        0,
    )
    assert (c.top_k, c.divergence_alpha, c.beta, c.std_normalize, c.success_threshold) == (
        100,
        0.5,
        1.0,
        False,
        0.5,
    )
    assert (c.mode, c.adv_mix_lambda, c.weight_scope) == ("srpo", 0.9, "batch")


@pytest.mark.parametrize(
    "data, key",
    [
        ({"eps_low": 1.5}, "eps_low"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"divergence_alpha": 2}, "divergence_alpha"),
        ({"top_k": 0}, "top_k"),
        ({"beta": -1}, "beta"),
        ({"mode": "ppo"}, "mode"),
        ({"temperature": 0}, "temperature"),
        ({"top_kk": 3}, "top_kk"),
    ],
)
def test_loss_config_rejects_bad_values_naming_the_key(data, key):
    with pytest.raises(ConfigError, match=key):
        from_dict(LossConfig, data)


def test_loss_config_from_yaml_values():
    c = from_dict(
        LossConfig,
        {"mode": "advantage_mix", "dual_clip": None, "tis_cap": "3", "weight_scope": "micro_batch"},
    )
    assert c.mode == "advantage_mix" and c.dual_clip is None and c.tis_cap == 3.0


def test_micro_batch_with_nothing_routed_still_backpropagates_zero():
    # Pure SDPO on an all-wrong group: no sample has a teacher, so no token takes any loss.
    cfg = LossConfig(mode="sdpo", top_k=4)
    prob = make_problem(seed=8, rewards=[[0.0, 0.0, 0.0]])
    x = prob.student.clone().requires_grad_()
    batch = build_batch(prob, cfg, x.detach(), prob.teacher)
    loss, _ = routed_loss(x, batch, global_normalizers([batch], cfg.beta), cfg)
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((x.grad == 0).all())


def test_routed_loss_metrics_are_consistent_sums():
    cfg = LossConfig(top_k=4)
    prob = make_problem(seed=9)
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    micro = batch.split(2)
    norm = global_normalizers(micro, cfg.beta)
    totals: dict[str, float] = {}
    loss_sum = 0.0
    for mb, x in zip(micro, torch.tensor_split(prob.student, [len(micro[0])]), strict=True):
        loss, m = routed_loss(x, mb, norm, cfg)
        loss_sum += float(loss.detach())
        for k, v in m.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    valid = int(prob.mask.sum())
    assert totals["tokens"] == valid == norm.num_tokens
    assert totals["grpo_tokens"] + totals["sdpo_tokens"] == valid  # srpo routes every valid token once
    assert totals["sdpo_tokens"] == norm.num_sdpo_tokens
    assert abs(totals["raw_weight_sum"] - norm.sum_raw_weights) < 1e-9
    assert abs((totals["grpo_loss_sum"] + totals["sdpo_loss_sum"]) / valid - loss_sum) < 1e-12


def test_fig1b_modes_add_up_to_pure_sdpo():
    # Same denominator, no dynamic weights: L_sdpo = L_incorrect_only + L_correct_only, value and gradient.
    prob = make_problem(seed=10)
    parts = [
        _ours(prob, LossConfig(mode=m, top_k=4), 2) for m in ("sdpo_incorrect_only", "sdpo_correct_only")
    ]
    whole, g_whole = _ours(prob, LossConfig(mode="sdpo", top_k=4), 2)
    assert parts[0][0] > 0 and parts[1][0] > 0
    assert abs(parts[0][0] + parts[1][0] - whole) <= 1e-12 * abs(whole)
    assert rel_err(parts[0][1] + parts[1][1], g_whole) < 1e-12


@pytest.mark.parametrize("mode", ["sdpo", "sdpo_incorrect_only", "sdpo_correct_only"])
def test_teacher_entropy_is_logged_in_every_sdpo_mode(mode):
    cfg = LossConfig(mode=mode, top_k=4)
    prob = make_problem(seed=11)
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    _, m = routed_loss(prob.student, batch, global_normalizers([batch], cfg.beta), cfg)
    rows = batch.sdpo & batch.mask
    assert abs(float(m["teacher_entropy_sum"]) - float(batch.teacher_entropy[rows].sum())) < 1e-9
    assert float(m["teacher_entropy_sum"]) > 0
    # the entropy weight w̃ = exp(−β·H) is logged in every SDPO mode too (its one computation for the logs)
    w = torch.exp(-cfg.beta * batch.teacher_entropy[rows].double())
    assert abs(float(m["raw_weight_sum"]) - float(w.sum())) < 1e-12
    assert abs(float(m["raw_weight_sq_sum"]) - float((w**2).sum())) < 1e-12
