"""The off-policy corrections against each anchor's own rule, as a float64 reference written here from
reading the anchors' code (nothing copied; the functions below are loops over sequences):

- slime, THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515:
  ``examples/train_infer_mismatch_helper/mis.py`` ``compute_mis_weights`` (``tis_mode: mask``, ``tis_level``
  token / sequence, the ±20 ``SAFETY_BOUND``), and ``slime/backends/megatron_utils/loss.py``
  ``policy_loss_function`` + ``cp_utils.get_sum_of_sample_mean``: the rejection masks the numerator, the
  denominators stay the pre-rejection totals (``rollout_mask_sums``; per token: ``num_tokens`` of the
  original ``loss_masks``; per sample: ÷ the step's sample count).
- miles, radixark/miles at 31f1ca961a94cb860cec3b2dea34ec332bfa8f76: ``loss_hub/losses.py`` — "modified
  masks correct the numerator only; denominators stay the precomputed rollout_mask_sums" — and its copy of
  ``mis.py``: the same rule as slime, so the same reference.
- verl, volcengine/verl at b178a3cd56f58b2d502255daba591e92833930a7:
  ``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_rollout_rejection_mask`` (``token_k1`` /
  ``seq_sum_k1`` = −log ρ clamped to ±20, bounds ``"lower_upper"`` on π_rollout/π_old, inclusive),
  ``compute_rollout_correction_weights`` (``rollout_is`` token / sequence, truncated at
  ``rollout_is_threshold``), the modified ``response_mask`` written back to the batch, and
  ``core_algos.agg_loss`` (token-mean, seq-mean-token-mean over the modified mask).

A sample here is one rollout (slime's per-rollout total of a one-sample rollout is that sample's count).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from srpo_megatron.config import ConfigError, LossConfig, from_dict
from srpo_megatron.losses import (
    TokenBatch,
    apply_rejections,
    global_normalizers,
    grpo_token_loss,
    importance,
    routed_loss,
    sdpo_token_loss,
    sequence_weights,
)
from srpo_megatron.losses.aggregation import aggregate
from srpo_megatron.losses.grpo import tis_weight
from tests.helpers.losses_reference import ref_routed_loss, rel_err
from tests.helpers.losses_scenario import build_batch, make_problem, ref_cfg, sample_offsets

SAFETY = 20.0  # the anchors' bound on |log ρ| before exp

# ---------------------------------------------------------------- the anchors' rules, float64, per sequence


def slime_mis(train, rollout, masks, level, lower, upper):
    """slime ``compute_mis_weights`` at ``tis_mode: mask``: per sequence, (weights, modified mask).

    ρ = exp(clamp(log ρ, ±20)) with log ρ = train − rollout per token, or its masked sum (``sequence``);
    kept where lower <= ρ <= upper; weights are ρ on valid tokens (kept or not), 0 on padding."""
    weights, modified = [], []
    for tr, ro, m in zip(train, rollout, masks, strict=True):
        raw = [a - b for a, b in zip(tr, ro, strict=True)]
        if level == "sequence":
            total = sum(r for r, v in zip(raw, m, strict=True) if v)
            logs = [total] * len(raw)
        else:
            logs = raw
        rho = [math.exp(min(max(x, -SAFETY), SAFETY)) for x in logs]
        weights.append([r if v else 0.0 for r, v in zip(rho, m, strict=True)])
        modified.append([bool(v) and lower <= r <= upper for r, v in zip(rho, m, strict=True)])
    return weights, modified


def slime_reduce(values, modified, masks, per_token):
    """slime / miles: Σ over the modified mask, ÷ the pre-rejection totals (per token: all valid tokens of
    the step; per sample: each sample's own count, then ÷ the step's sample count)."""
    if per_token:
        num = sum(
            x for xs, ms in zip(values, modified, strict=True) for x, k in zip(xs, ms, strict=True) if k
        )
        return num / sum(max(sum(bool(v) for v in m), 1) for m in masks)
    total = 0.0
    for xs, ms, m in zip(values, modified, masks, strict=True):
        total += sum(x for x, k in zip(xs, ms, strict=True) if k) / max(sum(bool(v) for v in m), 1)
    return total / len(masks)


def verl_rs(train, rollout, masks, option, threshold):
    """verl ``compute_rollout_rejection_mask``: per sequence, the modified response mask.

    k1 = −clamp(train − rollout, ±20) = log(π_rollout/π_old); ``threshold`` "lower_upper" keeps
    log(lower) <= k1 <= log(upper) (``token_k1``) or the masked sum of k1 (``seq_sum_k1``)."""
    lo_s, hi_s = threshold.split("_")
    lo, hi = math.log(float(lo_s)), math.log(float(hi_s))
    out = []
    for tr, ro, m in zip(train, rollout, masks, strict=True):
        k1 = [-min(max(a - b, -SAFETY), SAFETY) for a, b in zip(tr, ro, strict=True)]
        if option == "seq_sum_k1":
            s = sum(k for k, v in zip(k1, m, strict=True) if v)
            out.append([bool(v) and lo <= s <= hi for v in m])
        else:
            assert option == "token_k1"
            out.append([bool(v) and lo <= k <= hi for k, v in zip(k1, m, strict=True)])
    return out


def verl_is(train, rollout, masks, level, threshold):
    """verl ``compute_rollout_correction_weights``: exp(clamp(log ρ, ±20)) per token or of the sequence's
    masked sum, × mask, truncated at ``threshold``."""
    out = []
    for tr, ro, m in zip(train, rollout, masks, strict=True):
        raw = [a - b for a, b in zip(tr, ro, strict=True)]
        if level == "sequence":
            total = sum(r for r, v in zip(raw, m, strict=True) if v)
            logs = [total] * len(raw)
        else:
            logs = raw
        out.append(
            [
                min(math.exp(min(max(x, -SAFETY), SAFETY)), threshold) if v else 0.0
                for x, v in zip(logs, m, strict=True)
            ]
        )
    return out


def verl_agg(values, modified, mode):
    """verl ``agg_loss`` over the modified mask: token-mean, or seq-mean-token-mean over the sequences with
    a kept token (verl's 1e-8 guard on an empty sequence does not arise: those are excluded)."""
    if mode == "token-mean":
        num = sum(
            x for xs, ms in zip(values, modified, strict=True) for x, k in zip(xs, ms, strict=True) if k
        )
        return num / sum(k for ms in modified for k in ms)
    assert mode == "seq-mean-token-mean"
    means = [
        sum(x for x, k in zip(xs, ms, strict=True) if k) / sum(ms)
        for xs, ms in zip(values, modified, strict=True)
        if sum(ms)
    ]
    return sum(means) / len(means)


# ---------------------------------------------------------------- one batch, in both layouts

INF = math.inf


def _sequences(seed: int, spread: float = 1.2, with_inf: bool = False):
    """Per-sequence lists (train, rollout, mask, x): log ρ spread over both bounds; ``with_inf`` puts an
    engine log-prob of −inf (log ρ = +inf) and one of +inf (log ρ = −inf) in the batch, and a trainer
    log-prob of −inf."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 2, 4, 6, 3, 4, 5]
    train, rollout, masks, xs = [], [], [], []
    for i, n in enumerate(lengths):
        tr = (-torch.rand(n, generator=gen, dtype=torch.float64) * 3).tolist()
        scale = spread if i % 2 else spread / 4  # some sequences near ρ = 1, so sequence level keeps some
        ro = [a + scale * float(torch.randn(1, generator=gen, dtype=torch.float64)) for a in tr]
        m = [True] * n
        if i == 1:
            m[-1] = False  # padding
        train.append(tr)
        rollout.append(ro)
        masks.append(m)
        xs.append(torch.randn(n, generator=gen, dtype=torch.float64).tolist())
    if with_inf:
        rollout[0][1] = -INF
        rollout[2][0] = INF
        train[4][2] = -INF
    return train, rollout, masks, xs


def _batch(train, rollout, masks) -> tuple[TokenBatch, list[int]]:
    flat = lambda v: torch.tensor([a for s in v for a in s], dtype=torch.float64)  # noqa: E731
    mask = torch.tensor([a for s in masks for a in s])
    t = len(mask)
    offsets = [0]
    for s in masks:
        offsets.append(offsets[-1] + len(s))
    batch = TokenBatch(
        response_ids=torch.zeros(t, dtype=torch.long),
        mask=mask,
        advantages=torch.zeros(t, dtype=torch.float64),
        grpo=torch.ones(t, dtype=torch.bool),
        sdpo=torch.zeros(t, dtype=torch.bool),
        old_logp=flat(train),
        rollout_logp=flat(rollout),
    )
    return batch, offsets


def _ours(train, rollout, masks, xs, cfg: LossConfig, aggregation: str, n_micro: int = 1):
    """Our pipeline on per-token values x: apply_rejections → sequence_weights → global_normalizers over
    ``n_micro`` micro-batches → Σ aggregate(x · w on loss_rows). Returns (keep mask, weights, L)."""
    batch, offsets = _batch(train, rollout, masks)
    apply_rejections(batch, cfg, offsets)
    if aggregation == "seq_mean_token_mean":
        batch.seq_weight = sequence_weights(batch.mask, offsets)
    w = importance.bounded_is_weight(batch.old_logp, batch.rollout_logp, batch.seq_log_ratio, cfg)
    assert w is not None
    kept = importance.loss_rows(batch, cfg)
    x = torch.tensor([a for s in xs for a in s], dtype=torch.float64)
    micro = batch.split(n_micro)
    norm = global_normalizers(micro, cfg.beta)
    per_token = torch.where(kept, x * w, 0.0)
    bounds = [0]
    for mb in micro:
        bounds.append(bounds[-1] + len(mb))
    loss = sum(
        float(aggregate(per_token[a:b], mb, norm, aggregation))
        for a, b, mb in zip(bounds[:-1], bounds[1:], micro, strict=True)
    )
    return kept.tolist(), torch.where(kept, w, 0.0).tolist(), loss


def _flat(v):
    return [a for s in v for a in s]


def _same(a: list[float], b: list[float]) -> bool:
    """Equal up to the last bit or two (torch's exp and math.exp may round differently)."""
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=1e-15, abs_tol=0.0) for x, y in zip(a, b, strict=True)
    )


def _cfg(level: str, low: float, high: float, denominator: str = "drop") -> LossConfig:
    return LossConfig(
        is_correction="mis", is_level=level, is_low=low, is_high=high, is_rejection_denominator=denominator
    )


LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1"}


def _matches_slime(seed, level, low, high, per_token, with_inf=False, n_micro=1) -> bool:
    """Ours under ``keep`` == slime's (and miles') rule: same keep-mask, weights and reduced loss."""
    train, rollout, masks, xs = _sequences(seed, with_inf=with_inf)
    agg = "token_mean" if per_token else "seq_mean_token_mean"
    kept, w, loss = _ours(train, rollout, masks, xs, _cfg(level, low, high, "keep"), agg, n_micro)
    sw, smod = slime_mis(train, rollout, masks, level, low, high)
    values = [[x * a for x, a in zip(xv, wv, strict=True)] for xv, wv in zip(xs, sw, strict=True)]
    ref = slime_reduce(values, smod, masks, per_token)
    kept_w = [a if k else 0.0 for a, k in zip(_flat(sw), _flat(smod), strict=True)]
    return kept == _flat(smod) and _same(w, kept_w) and abs(loss - ref) <= 1e-12 * abs(ref)


def _matches_verl(seed, level, low, high, mode, threshold, with_inf=False, n_micro=1) -> bool:
    """Ours under ``drop`` with bounds [low, high] == verl's rejection at ``threshold`` with its IS weight
    truncated at ``high`` (never acting on a kept token)."""
    train, rollout, masks, xs = _sequences(seed, with_inf=with_inf)
    agg = "token_mean" if mode == "token-mean" else "seq_mean_token_mean"
    kept, w, loss = _ours(train, rollout, masks, xs, _cfg(level, low, high, "drop"), agg, n_micro)
    vmod = verl_rs(train, rollout, masks, LEVELS[level], threshold)
    vw = verl_is(train, rollout, masks, level, high)
    values = [[x * a for x, a in zip(xv, wv, strict=True)] for xv, wv in zip(xs, vw, strict=True)]
    ref = verl_agg(values, vmod, mode)
    kept_w = [a if k else 0.0 for a, k in zip(_flat(vw), _flat(vmod), strict=True)]
    return kept == _flat(vmod) and _same(w, kept_w) and abs(loss - ref) <= 1e-12 * abs(ref)


def _verl_threshold(low: float, high: float) -> str:
    """Our [low, high] on π_old/π_rollout as verl's "lower_upper" on π_rollout/π_old."""
    return f"{1.0 / high!r}_{1.0 / low!r}"


BOUNDS = {"default": (0.5, 5.0), "narrow": (0.8, 1.25), "wide": (1e-12, 1e12)}


# ---------------------------------------------------------------- keep = slime / miles, drop = verl


@pytest.mark.parametrize("with_inf", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("bounds", list(BOUNDS))
@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_sample"])
@pytest.mark.parametrize("level", list(LEVELS))
def test_keep_equals_slime_and_miles_rule(level, per_token, bounds, with_inf):
    low, high = BOUNDS[bounds]
    assert _matches_slime(3, level, low, high, per_token, with_inf)
    assert _matches_slime(3, level, low, high, per_token, with_inf, n_micro=3)  # split: same totals


@pytest.mark.parametrize("with_inf", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("bounds", list(BOUNDS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level", list(LEVELS))
def test_drop_equals_verl_rule_with_inverted_bounds(level, mode, bounds, with_inf):
    low, high = BOUNDS[bounds]
    assert _matches_verl(3, level, low, high, mode, _verl_threshold(low, high), with_inf)
    assert _matches_verl(3, level, low, high, mode, _verl_threshold(low, high), with_inf, n_micro=3)


def test_the_default_bounds_are_verl_0_2_2_and_verl_0_5_5_keeps_other_tokens():
    assert _verl_threshold(0.5, 5.0) == "0.2_2.0"
    train, rollout, masks, xs = _sequences(3)
    ours = _ours(train, rollout, masks, xs, _cfg("token", 0.5, 5.0), "token_mean")[0]
    same = _flat(verl_rs(train, rollout, masks, "token_k1", "0.2_2.0"))
    literal = _flat(verl_rs(train, rollout, masks, "token_k1", "0.5_5.0"))  # the same numbers, unconverted
    assert ours == same and ours != literal


def test_keep_and_drop_differ_on_this_batch():
    # so that a keep falling back to drop (or the reverse) cannot pass both anchor tests
    train, rollout, masks, xs = _sequences(3)
    for agg in ("token_mean", "seq_mean_token_mean"):
        keep = _ours(train, rollout, masks, xs, _cfg("token", 0.5, 5.0, "keep"), agg)
        drop = _ours(train, rollout, masks, xs, _cfg("token", 0.5, 5.0, "drop"), agg)
        assert keep[0] == drop[0] and not all(keep[0]) and abs(keep[2] - drop[2]) > 1e-6


# ---------------------------------------------------------------- planted bugs fail the anchor tests


def _flipped(old_logp, rollout_logp, seq_log_ratio, cfg):  # verl's orientation: log(π_rollout / π_old)
    return -_LOG_RATIO(old_logp, rollout_logp, seq_log_ratio, cfg)


_LOG_RATIO = importance._log_ratio


def _keep_forgets_the_totals(batch, cfg, offsets):  # keep clears the rejected rows, like drop
    return _APPLY_REJECTIONS(batch, LossConfig(**{**vars(cfg), "is_rejection_denominator": "drop"}), offsets)


_APPLY_REJECTIONS = importance.apply_rejections


def _unclamped(log_ratio):
    return log_ratio.detach().exp()


def test_planted_flipped_orientation_fails_both_anchor_tests(monkeypatch):
    assert _matches_slime(3, "token", 0.5, 5.0, True) and _matches_verl(
        3, "token", 0.5, 5.0, "token-mean", "0.2_2.0"
    )
    monkeypatch.setattr(importance, "_log_ratio", _flipped)
    assert not _matches_slime(3, "token", 0.5, 5.0, True)
    assert not _matches_verl(3, "token", 0.5, 5.0, "token-mean", "0.2_2.0")


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_sample"])
def test_planted_keep_without_the_pre_rejection_totals_fails_the_slime_test(per_token, monkeypatch):
    assert _matches_slime(3, "token", 0.5, 5.0, per_token)
    monkeypatch.setattr(sys.modules[__name__], "apply_rejections", _keep_forgets_the_totals)
    assert not _matches_slime(3, "token", 0.5, 5.0, per_token)


def test_planted_missing_clamp_fails_the_inf_anchor_tests(monkeypatch):
    # With the wide bounds a +inf log-ratio is kept at e^20 by slime and verl; unclamped it is rejected.
    assert _matches_slime(3, "token", 1e-12, 1e12, True, with_inf=True)
    monkeypatch.setattr(importance, "clamped_exp", _unclamped)
    assert not _matches_slime(3, "token", 1e-12, 1e12, True, with_inf=True)
    assert not _matches_verl(
        3, "token", 1e-12, 1e12, "token-mean", _verl_threshold(1e-12, 1e12), with_inf=True
    )


# ---------------------------------------------------------------- the ±20 clamp


def test_infinite_log_probs_give_finite_detached_weights_in_every_correction():
    old = torch.tensor([-1.0, -1.0, -INF, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([-INF, INF, -1.0, -2.0, -0.7], dtype=torch.float64)
    e20 = math.exp(20.0)
    w = tis_weight(old, rollout, 1e30)  # cap far above e^20: the clamp alone bounds the weight
    assert w is not None and not w.requires_grad and bool(torch.isfinite(w).all())
    assert _same(w.tolist(), [e20, math.exp(-20.0), math.exp(-20.0), 1.0, math.exp(0.2)])
    for name in ("mis", "icepop"):
        cfg = LossConfig(is_correction=name, is_low=1e-12, is_high=1e12)
        bw = importance.bounded_is_weight(old, rollout, None, cfg)
        assert bw is not None and not bw.requires_grad and bool(torch.isfinite(bw).all())
        assert _same(bw[:3].tolist(), [e20, math.exp(-20.0), math.exp(-20.0)])
    seq = importance.sequence_log_ratio(old, rollout, torch.ones(5, dtype=torch.bool), [0, 2, 5])
    cfg = LossConfig(is_correction="mis", is_level="sequence", is_low=1e-12, is_high=1e12)
    # sample 0: +inf + (−inf) is NaN, which counts as outside (weight 0); sample 1: −inf → e^−20
    bw = importance.bounded_is_weight(old, rollout, seq, cfg)
    assert bw is not None and _same(bw.tolist(), [0.0, 0.0] + [math.exp(-20.0)] * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_log_ratios_inside_the_clamp_give_the_same_weights_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(9)
    old = (-3 * torch.rand(200, generator=gen, dtype=torch.float64)).to(dtype)
    rollout = (old.double() + 4 * torch.randn(200, generator=gen, dtype=torch.float64)).to(dtype)
    before = (old - rollout).exp()  # the unclamped formula
    assert float((old - rollout).abs().max()) < 20.0 and float((old - rollout).abs().max()) > 8.0
    w = tis_weight(old, rollout, 2.0)
    assert w is not None and torch.equal(w, before.clamp(max=2.0))
    for name in ("mis", "icepop"):
        cfg = LossConfig(is_correction=name, is_low=0.01, is_high=100.0)
        inside = (before >= 0.01) & (before <= 100.0)
        bw = importance.bounded_is_weight(old, rollout, None, cfg)
        assert bw is not None and torch.equal(bw, torch.where(inside, before, 0.0))


def _inf_problem(seed: int):
    prob = make_problem(seed=seed)
    gen = torch.Generator().manual_seed(300 + seed)
    prob.rollout_logp = prob.old_logp + 0.4 * torch.randn(
        len(prob.old_logp), generator=gen, dtype=torch.float64
    )
    valid = prob.mask.nonzero().squeeze(1).tolist()
    prob.rollout_logp[valid[0]] = -INF  # the engine gave the sampled token probability 0: log ρ = +inf
    prob.rollout_logp[valid[5]] = INF  # log ρ = −inf
    prob.old_logp[valid[9]] = -INF  # the trainer gives it probability 0: log ρ = −inf, PPO ratio clamped
    return prob


@pytest.mark.parametrize(
    "extra",
    [
        {"is_correction": "tis"},
        {"is_correction": "tis", "tis_cap": 1e30},
        {"is_correction": "icepop", "is_low": 1e-12, "is_high": 1e12},
        {"is_correction": "mis", "is_low": 1e-12, "is_high": 1e12},
        {"is_correction": "mis", "is_level": "sequence", "is_low": 0.5, "is_high": 5.0},
        {"is_correction": "mis", "is_low": 1e-12, "is_high": 1e12, "is_rejection_denominator": "keep"},
    ],
    ids=["tis", "tis-uncapped", "icepop-wide", "mis-wide", "mis-sequence", "mis-keep"],
)
@pytest.mark.parametrize("mode", ["srpo", "grpo"])
def test_infinite_log_probs_leave_the_loss_and_its_gradient_finite(extra, mode):
    cfg = LossConfig(top_k=4, kl_coef=0.02, entropy_coef=0.01, mode=mode, **extra)
    prob = _inf_problem(seed=11)
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    apply_rejections(batch, cfg, sample_offsets(prob))
    x = prob.student.clone().requires_grad_()
    loss, _ = routed_loss(x, batch, global_normalizers([batch], cfg.beta), cfg)
    (g,) = torch.autograd.grad(loss, x)
    assert math.isfinite(float(loss)) and bool(torch.isfinite(g).all())


def test_the_token_losses_take_finite_weights_from_infinite_engine_log_probs():
    logp = torch.tensor([-1.0, -1.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    rollout = torch.tensor([-INF, INF], dtype=torch.float64)
    loss, m = grpo_token_loss(logp, old, torch.ones(2, dtype=torch.float64), rollout, tis_cap=1e30)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert bool(torch.isfinite(loss).all() and torch.isfinite(g).all())
    assert _same(m["tis_weight"].tolist(), [math.exp(20.0), math.exp(-20.0)])
    p = torch.log_softmax(torch.randn(2, 3, dtype=torch.float64), -1).requires_grad_()
    q = torch.log_softmax(torch.randn(2, 3, dtype=torch.float64), -1)
    s_loss, _ = sdpo_token_loss(p, q, logp.detach(), old, rollout, tis_cap=1e30)
    (g,) = torch.autograd.grad(s_loss.sum(), p)
    assert bool(torch.isfinite(s_loss).all() and torch.isfinite(g).all())


# ---------------------------------------------------------------- the whole routed loss, keep vs drop


def _problem(seed: int):
    prob = make_problem(seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    prob.rollout_logp = prob.old_logp + 0.4 * torch.randn(
        len(prob.old_logp), generator=gen, dtype=torch.float64
    )
    return prob


def _routed(prob, cfg, n_micro, stale=None):
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    if stale is not None:
        batch.stale = torch.tensor(stale)
    counts = apply_rejections(batch, cfg, sample_offsets(prob))
    if cfg.aggregation == "seq_mean_token_mean":  # after the rejections, as trainer/passes/scoring.py
        batch.seq_weight = sequence_weights(batch.mask, sample_offsets(prob))
    micro = batch.split(n_micro)
    norm = global_normalizers(micro, cfg.beta)
    cuts = torch.tensor([len(m) for m in micro]).cumsum(0)[:-1].tolist()
    xs = [p.clone().requires_grad_() for p in torch.tensor_split(prob.student, cuts)]
    total, grads, metrics = 0.0, [], {k: float(v) for k, v in counts.items()}
    for xm, mb in zip(xs, micro, strict=True):
        loss, m = routed_loss(xm, mb, norm, cfg)
        (g,) = torch.autograd.grad(loss, xm)
        total += float(loss.detach())
        grads.append(g)
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    return total, torch.cat(grads), norm, metrics


def _reference(prob, cfg, stale=None):
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
        stale=stale,
    )
    (g,) = torch.autograd.grad(loss, x)
    return float(loss.detach()), g


def _whole(level: str, denominator: str, mode: str, aggregation: str, **extra) -> LossConfig:
    bounds = {"token": (0.8, 1.25), "sequence": (0.7, 1.4)}[level]
    return LossConfig(
        top_k=4,
        temperature=0.9,
        kl_coef=0.02,
        entropy_coef=0.01,
        mode=mode,
        aggregation=aggregation,
        is_correction="mis",
        is_level=level,
        is_low=bounds[0],
        is_high=bounds[1],
        is_rejection_denominator=denominator,
        **extra,
    )


def _close(prob, cfg, n_micro, stale=None) -> bool:
    loss, g, _, _ = _routed(prob, cfg, n_micro, stale)
    ref_loss, ref_g = _reference(prob, cfg, stale)
    return abs(loss - ref_loss) <= 1e-9 * abs(ref_loss) and rel_err(g, ref_g) < 1e-9


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("mode", ["srpo", "grpo", "sdpo"])
@pytest.mark.parametrize("denominator", ["drop", "keep"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_routed_loss_keep_and_drop_match_the_float64_reference(level, denominator, mode, aggregation):
    cfg = _whole(level, denominator, mode, aggregation)
    prob = _problem(seed=1)
    assert _close(prob, cfg, n_micro=1) and _close(prob, cfg, n_micro=3)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_routed_keep_counts_rejected_tokens_and_differs_from_drop(aggregation):
    prob = _problem(seed=1)
    valid = int(prob.mask.sum())
    keep = _routed(prob, _whole("token", "keep", "srpo", aggregation), 2)
    drop = _routed(prob, _whole("token", "drop", "srpo", aggregation), 2)
    rejected = drop[3]["rejected_tokens"]
    assert rejected > 0 and keep[3]["rejected_tokens"] == rejected
    assert keep[2].num_tokens == valid and drop[2].num_tokens == valid - rejected
    assert keep[3]["tokens"] == drop[3]["tokens"] == valid - rejected  # the tokens that took loss
    assert abs(keep[0] - drop[0]) > 1e-6


def test_planted_keep_as_drop_fails_the_whole_loss_reference(monkeypatch):
    cfg = _whole("token", "keep", "srpo", "seq_mean_token_mean")
    prob = _problem(seed=1)
    assert _close(prob, cfg, n_micro=2)
    monkeypatch.setattr(sys.modules[__name__], "apply_rejections", _keep_forgets_the_totals)
    assert not _close(prob, cfg, n_micro=2)


def test_dp_ranks_summing_their_shares_give_the_keep_loss():
    # Two "ranks" of two prompt groups each: global_normalizers over both ranks' micro-batches is what the
    # DP all-reduce sums; the shares of L add up to the single-rank loss.
    from tests.helpers.losses_scenario import group_slice

    cfg = _whole("sequence", "keep", "srpo", "seq_mean_token_mean")
    prob = _problem(seed=2)
    whole, _, _, _ = _routed(prob, cfg, 1)
    parts = []
    for lo, hi in ((0, 2), (2, 4)):
        part, _ = group_slice(prob, lo, hi)
        batch = build_batch(part, cfg, part.student, part.teacher)
        apply_rejections(batch, cfg, sample_offsets(part))
        batch.seq_weight = sequence_weights(batch.mask, sample_offsets(part))
        parts.append((part, batch.split(2)))
    norm = global_normalizers([mb for _, micro in parts for mb in micro], cfg.beta)
    total = 0.0
    for part, micro in parts:
        cuts = torch.tensor([len(m) for m in micro]).cumsum(0)[:-1].tolist()
        for xm, mb in zip(torch.tensor_split(part.student, cuts), micro, strict=True):
            total += float(routed_loss(xm, mb, norm, cfg)[0])
    assert abs(total - whole) <= 1e-12 * abs(whole)


# ---------------------------------------------------------------- stale tokens and the sequence ratio


def _stale_batch():
    """Two samples of three tokens; sample 0's first token is stale and carries log ρ = +1.2, its other
    two +0.1 each: with the stale token ρ_0 = e^1.4 ≈ 4.06 > 2, without it e^0.2 ≈ 1.22 (inside)."""
    train = [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]
    rollout = [[-2.2, -1.1, -1.1], [-1.0, -1.05, -0.95]]
    batch, offsets = _batch(train, rollout, [[True] * 3, [True] * 3])
    batch.stale = torch.tensor([True, False, False, False, False, False])
    return batch, offsets


@pytest.mark.parametrize("denominator", ["drop", "keep"])
def test_the_sequence_ratio_counts_stale_tokens_and_rejects_the_whole_sample(denominator):
    cfg = LossConfig(
        is_correction="mis",
        is_level="sequence",
        is_low=0.5,
        is_high=2.0,
        mask_stale_tokens=True,
        is_rejection_denominator=denominator,
    )
    batch, offsets = _stale_batch()
    counts = apply_rejections(batch, cfg, offsets)
    assert batch.seq_log_ratio is not None
    assert torch.allclose(batch.seq_log_ratio, torch.tensor([1.4] * 3 + [0.0] * 3, dtype=torch.float64))
    # sample 0 is rejected whole (its ratio includes the stale token), sample 1 is kept
    assert importance.loss_rows(batch, cfg).tolist() == [False] * 3 + [True] * 3
    assert float(counts["rejected_tokens"]) == 3 and float(counts["stale_tokens"]) == 1
    # the stale token leaves the denominators under both choices; the rejected fresh ones only under drop
    assert batch.mask.tolist() == ([False] * 3 if denominator == "drop" else [False, True, True]) + [True] * 3


def _ratio_without_stale(old_logp, rollout_logp, mask, offsets):  # the other choice, planted
    return _SEQUENCE_LOG_RATIO(old_logp, rollout_logp, mask & ~_STALE[0], offsets)


_SEQUENCE_LOG_RATIO = importance.sequence_log_ratio
_STALE: list[torch.Tensor] = []


def test_planted_sequence_ratio_without_stale_tokens_fails_the_decision_test(monkeypatch):
    batch, _ = _stale_batch()
    _STALE[:] = [batch.stale]
    monkeypatch.setattr(importance, "sequence_log_ratio", _ratio_without_stale)
    with pytest.raises(AssertionError):
        test_the_sequence_ratio_counts_stale_tokens_and_rejects_the_whole_sample("drop")


# ---------------------------------------------------------------- the key


def test_the_rejection_denominator_key_defaults_to_drop_and_rejects_bad_values():
    assert LossConfig().is_rejection_denominator == "drop"
    assert (
        from_dict(
            LossConfig, {"is_correction": "mis", "is_rejection_denominator": "keep"}
        ).is_rejection_denominator
        == "keep"
    )
    with pytest.raises(ConfigError, match=r"is_rejection_denominator.*'sum'.*drop.*keep"):
        from_dict(LossConfig, {"is_correction": "mis", "is_rejection_denominator": "sum"})
    with pytest.raises(ConfigError, match=r"loss\.is_rejection_denominator='keep'.*is_correction: mis"):
        from_dict(LossConfig, {"is_correction": "icepop", "is_rejection_denominator": "keep"})
