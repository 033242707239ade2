"""Off-policy corrections (loss.is_correction tis | mis | icepop, loss.mask_stale_tokens) against a float64
reference written from the definitions (tests/helpers/losses_reference.ref_off_policy), in values and in
gradients with respect to the student logits, through ``routed_loss``; planted variants must fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from srpo_megatron.config import ConfigError, LossConfig, from_dict
from srpo_megatron.losses import (
    apply_rejections,
    global_normalizers,
    grpo_token_loss,
    importance,
    routed_loss,
    sdpo_token_loss,
)
from srpo_megatron.trainer.microbatches.batches import sample_tokens
from srpo_megatron.trainer.observe.step_metrics import step_metrics
from srpo_megatron.trainer.step_types import RolloutBatch, Sample, StepStats
from tests.helpers.losses_reference import ref_off_policy, ref_routed_loss, rel_err
from tests.helpers.losses_scenario import build_batch, make_problem, ref_cfg

CORRECTIONS = {
    "tis": {"is_correction": "tis"},
    "mis-token": {"is_correction": "mis", "is_level": "token", "is_low": 0.8, "is_high": 1.25},
    "mis-sequence": {"is_correction": "mis", "is_level": "sequence", "is_low": 0.7, "is_high": 1.4},
    "icepop": {"is_correction": "icepop", "is_low": 0.8, "is_high": 1.25},
}


def _problem(seed: int, spread: float = 0.4):
    """The shared scenario with π_rollout spread so that ratios fall below, inside and above the bounds."""
    prob = make_problem(seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    prob.rollout_logp = prob.old_logp + spread * torch.randn(
        len(prob.old_logp), generator=gen, dtype=torch.float64
    )
    return prob


def _stale(prob, seed: int) -> list[bool]:
    gen = torch.Generator().manual_seed(200 + seed)
    return (torch.rand(len(prob.sample_of_token), generator=gen) < 0.3).tolist()


def _offsets(prob) -> list[int]:
    out = [0]
    for s in range(len(prob.rewards) * len(prob.rewards[0])):
        out.append(out[-1] + prob.sample_of_token.count(s))
    return out


def _ours(prob, cfg, n_micro=2, stale=None):
    """Loss, gradient [T, V] and summed metrics of routed_loss over ``n_micro`` micro-batches, with the
    trainer's order: score (build_batch) → apply_rejections → global_normalizers → routed_loss."""
    x = prob.student
    batch = build_batch(prob, cfg, x, prob.teacher)
    if stale is not None:
        batch.stale = torch.tensor(stale)
    counts = apply_rejections(batch, cfg, _offsets(prob)) if cfg.rejects_tokens else {}
    micro = batch.split(n_micro)
    norm = global_normalizers(micro, cfg.beta)
    cuts = torch.tensor([len(m) for m in micro]).cumsum(0)[:-1].tolist()
    xs = [p.clone().requires_grad_() for p in torch.tensor_split(x, cuts)]
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


def _matches(prob, cfg, stale=None) -> bool:
    loss, g, _, _ = _ours(prob, cfg, stale=stale)
    ref_loss, ref_g = _reference(prob, cfg, stale)
    return abs(loss - ref_loss) <= 1e-9 * abs(ref_loss) and rel_err(g, ref_g) < 1e-9


def _cfg(name: str, **extra) -> LossConfig:
    return LossConfig(top_k=4, temperature=0.9, kl_coef=0.02, entropy_coef=0.01, **CORRECTIONS[name], **extra)


def _ratio_sides(prob, cfg) -> tuple[int, int, int]:
    """Valid tokens (or, at sequence level, samples) below, inside and above [is_low, is_high]."""
    log_rho = (prob.old_logp - prob.rollout_logp).where(prob.mask, 0.0)
    if cfg.is_level == "sequence":
        tok = torch.tensor(prob.sample_of_token)
        log_rho = torch.zeros(int(tok.max()) + 1, dtype=torch.float64).index_add(0, tok, log_rho)
    else:
        log_rho = log_rho[prob.mask]
    rho = log_rho.exp()
    return (
        int((rho < cfg.is_low).sum()),
        int(((rho >= cfg.is_low) & (rho <= cfg.is_high)).sum()),
        int((rho > cfg.is_high).sum()),
    )


# ---------------------------------------------------------------- each correction vs the reference


@pytest.mark.parametrize("mode", ["srpo", "grpo", "sdpo"])
@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_correction_matches_the_float64_reference_in_value_and_gradient(name, mode):
    cfg = _cfg(name, mode=mode)
    prob = _problem(seed=1)
    if name != "tis":
        low, inside, high = _ratio_sides(prob, cfg)
        assert low and inside and high, (low, inside, high)  # both bounds are exercised
    loss, g, _, _ = _ours(prob, cfg)
    ref_loss, ref_g = _reference(prob, cfg)
    assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss)
    assert rel_err(g, ref_g) < 1e-9


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_correction_is_micro_batch_invariant(name):
    cfg = _cfg(name)
    prob = _problem(seed=2)
    loss1, g1, _, _ = _ours(prob, cfg, n_micro=1)
    loss4, g4, _, _ = _ours(prob, cfg, n_micro=4)
    assert abs(loss4 - loss1) <= 1e-12 * abs(loss1) and rel_err(g4, g1) < 1e-12


def test_corrections_differ_from_each_other_on_this_batch():
    # So that a correction silently falling back to another one could not pass the reference test.
    prob = _problem(seed=1)
    losses = {name: _ours(prob, _cfg(name))[0] for name in CORRECTIONS}
    values = list(losses.values())
    assert all(abs(a - b) > 1e-6 for i, a in enumerate(values) for b in values[i + 1 :]), losses


def test_bounds_that_admit_every_ratio_weight_by_the_plain_ratio_like_uncapped_tis():
    prob = _problem(seed=3, spread=1.0)
    assert float((prob.old_logp - prob.rollout_logp)[prob.mask].exp().max()) > 3.0  # far above TIS's cap 2
    wide = {"is_low": 1e-12, "is_high": 1e12}
    tis, _, _, _ = _ours(prob, _cfg("tis", tis_cap=1e30))
    for name in ("mis-token", "icepop"):
        loss, _, _, _ = _ours(prob, LossConfig(**{**vars(_cfg(name)), **wide}))
        assert abs(loss - tis) <= 1e-12 * abs(tis)


# ---------------------------------------------------------------- denominators


def test_mis_rejections_leave_every_denominator_and_icepop_zeros_stay_in_n_tokens():
    prob = _problem(seed=4)
    valid = int(prob.mask.sum())
    for name in ("mis-token", "mis-sequence", "icepop"):
        cfg = _cfg(name)
        kept, weight = ref_off_policy(
            prob.sample_of_token, prob.mask, prob.old_logp, prob.rollout_logp, ref_cfg(cfg)
        )
        _, _, norm, m = _ours(prob, cfg)
        zero = sum(1 for k, w in zip(kept, weight, strict=True) if k and w == 0.0)
        if name == "icepop":
            assert norm.num_tokens == valid and m["is_zeroed_tokens"] == zero > 0
        else:
            assert norm.num_tokens == sum(kept) < valid
            assert m["rejected_tokens"] == valid - sum(kept) and m["is_zeroed_tokens"] == 0
        assert m["tokens"] == norm.num_tokens


def test_tis_rejects_nothing_and_keeps_the_batch_mask():
    cfg = LossConfig(top_k=4)
    prob = _problem(seed=4)
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    assert not cfg.rejects_tokens
    counts = apply_rejections(batch, cfg, _offsets(prob))
    assert float(counts["rejected_tokens"]) == 0.0 and torch.equal(batch.mask, prob.mask)


# ---------------------------------------------------------------- stale tokens


@pytest.mark.parametrize("name", ["tis", "icepop"])
def test_stale_tokens_get_exactly_zero_gradient_and_the_rest_matches_the_reference(name):
    cfg = _cfg(name, mask_stale_tokens=True)
    prob = _problem(seed=5)
    stale = _stale(prob, 5)
    loss, g, norm, m = _ours(prob, cfg, stale=stale)
    ref_loss, ref_g = _reference(prob, cfg, stale)
    rows = torch.tensor(stale) & prob.mask
    assert int(rows.sum()) >= 3
    assert bool((g[rows] == 0).all())
    assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss) and rel_err(g, ref_g) < 1e-9
    assert norm.num_tokens == int(prob.mask.sum()) - int(rows.sum()) == m["tokens"]
    assert m["stale_tokens"] == int(rows.sum())
    # Without the mask the same rows do take gradient, so the zero check above can fail.
    _, g_all, _, _ = _ours(prob, _cfg(name), stale=stale)
    assert bool((g_all[rows].abs().amax(dim=1) > 0).any())


def test_stale_and_mis_rejections_together_count_each_token_once():
    cfg = _cfg("mis-token", mask_stale_tokens=True)
    prob = _problem(seed=6)
    stale = _stale(prob, 6)
    assert _matches(prob, cfg, stale)
    kept, _ = ref_off_policy(
        prob.sample_of_token, prob.mask, prob.old_logp, prob.rollout_logp, ref_cfg(cfg), stale
    )
    _, _, norm, m = _ours(prob, cfg, stale=stale)
    assert m["rejected_tokens"] == int(prob.mask.sum()) - sum(kept) and norm.num_tokens == sum(kept)


def _sample(versions: list[int] | None, version: int, n: int = 3) -> Sample:
    return Sample(0, 0, [1, 2], list(range(n)), [0.0] * n, weight_version=version, token_versions=versions)


def test_sample_tokens_marks_tokens_older_than_the_bound_stale():
    samples = [_sample(None, 4), _sample([2, 3, 5], 2), _sample(None, 3)]
    cpu = torch.device("cpu")
    assert sample_tokens(samples, 2, cpu).stale is None  # no trainer version: nothing is marked
    # trainer at version 5, bound N = 2: staleness 1, 1, 1 | 3, 2, 0 | 2, 2, 2
    stale = sample_tokens(samples, 2, cpu, trainer_version=5, max_staleness=2).stale
    assert stale is not None and stale.tolist() == [False] * 3 + [True, False, False] + [False] * 3
    stale = sample_tokens(samples, 2, cpu, trainer_version=5, max_staleness=1).stale
    assert stale is not None and stale.tolist() == [False] * 3 + [True, True, False] + [True] * 3


def test_sample_tokens_refuses_token_versions_of_the_wrong_length():
    with pytest.raises(ValueError, match="one per token"):
        sample_tokens([_sample([1, 2], 1)], 2, torch.device("cpu"), trainer_version=3)


# ---------------------------------------------------------------- refusals


def test_routed_loss_refuses_a_batch_whose_rejections_were_not_applied():
    prob = _problem(seed=7)
    for cfg, stale in ((_cfg("mis-token"), None), (_cfg("tis", mask_stale_tokens=True), _stale(prob, 7))):
        batch = build_batch(prob, cfg, prob.student, prob.teacher)
        batch.stale = None if stale is None else torch.tensor(stale)
        with pytest.raises(ValueError, match="apply_rejections"):
            routed_loss(prob.student, batch, global_normalizers([batch], cfg.beta), cfg)


def test_mask_stale_tokens_without_token_versions_is_refused():
    cfg = _cfg("tis", mask_stale_tokens=True)
    prob = _problem(seed=7)
    batch = build_batch(prob, cfg, prob.student, prob.teacher)
    with pytest.raises(ValueError, match="trainer_version"):
        apply_rejections(batch, cfg, _offsets(prob))


def test_an_is_weight_and_engine_log_probs_together_are_refused():
    t = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="not both"):
        grpo_token_loss(t, t, t, t, is_weight=t)


# ---------------------------------------------------------------- the default is the paper's TIS


def test_default_tis_weights_each_token_loss_by_the_capped_ratio_exactly():
    gen = torch.Generator().manual_seed(8)
    logp, old, adv = (torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(3))
    rollout = old + 0.8 * torch.randn(64, generator=gen, dtype=torch.float64)
    assert LossConfig().is_correction == "tis" and not LossConfig().rejects_tokens
    w = torch.exp(old - rollout).clamp(max=2.0)  # min(π_old / π_rollout, 2), the paper's cap
    assert bool((w == 2.0).any()) and bool((w < 2.0).any())
    with_tis, _ = grpo_token_loss(logp, old, adv, rollout)
    without, _ = grpo_token_loss(logp, old, adv, None, tis_cap=None)
    assert torch.equal(with_tis, without * w)
    p = torch.log_softmax(torch.randn(64, 5, generator=gen, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(64, 5, generator=gen, dtype=torch.float64), -1)
    with_tis, _ = sdpo_token_loss(p, q, logp, old, rollout)
    without, _ = sdpo_token_loss(p, q, logp, old, None, tis_cap=None)
    assert torch.equal(with_tis, without * w)


# ---------------------------------------------------------------- planted bugs


def _one_sided(old_logp, rollout_logp, seq_log_ratio, cfg):  # IcePop with only the upper bound
    if cfg.is_correction == "tis" or rollout_logp is None:
        return None
    return importance._log_ratio(old_logp, rollout_logp, seq_log_ratio, cfg).exp() > cfg.is_high


def _per_token_sequence(old_logp, rollout_logp, mask, offsets):  # "sequence" ratio left per token
    return old_logp - rollout_logp


_REJECTED_ROWS = importance.rejected_rows


def _stale_ignored(batch, cfg):  # the stale rows never reported
    return None, _REJECTED_ROWS(batch, cfg)[1]


def _weight_one(old_logp, rollout_logp, seq_log_ratio, cfg):  # MIS keeps weight 1 instead of ρ
    outside = importance.outside_bounds(old_logp, rollout_logp, seq_log_ratio, cfg)
    return None if outside is None else torch.where(outside, 0.0, torch.ones_like(old_logp))


PLANTS = {
    "icepop one-sided mask": ("icepop", {}, "outside_bounds", _one_sided),
    "mis sequence ratio per token": ("mis-sequence", {}, "sequence_log_ratio", _per_token_sequence),
    "stale mask ignored": ("tis", {"mask_stale_tokens": True}, "rejected_rows", _stale_ignored),
    "mis weight 1 instead of the ratio": ("mis-token", {}, "bounded_is_weight", _weight_one),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bugs_fail_the_reference_comparison(plant, monkeypatch):
    name, extra, attr, fake = PLANTS[plant]
    cfg = _cfg(name, **extra)
    prob = _problem(seed=1)
    stale = _stale(prob, 1) if cfg.mask_stale_tokens else None
    assert _matches(prob, cfg, stale)  # the real code passes
    if attr == "bounded_is_weight":  # routed.py holds its own reference to it
        monkeypatch.setattr("srpo_megatron.losses.routed.bounded_is_weight", fake)
    else:
        monkeypatch.setattr(importance, attr, fake)
    assert not _matches(prob, cfg, stale)


# ---------------------------------------------------------------- metrics and config


def test_step_metrics_report_the_masked_shares_of_all_scored_tokens():
    s = StepStats(
        tokens=6.0, rejected_tokens=4.0, stale_tokens=1.0, is_zeroed_tokens=2.0, optimizer_steps=1.0
    )
    m = step_metrics(RolloutBatch([]), s, 0.0, 1.0)
    assert m["loss/is_masked_frac"] == (4 - 1 + 2) / 10 and m["loss/stale_masked_frac"] == 1 / 10
    assert m["tokens/total"] == 6.0


def test_off_policy_defaults_are_the_papers_tis():
    c = LossConfig()
    assert (c.is_correction, c.is_level, c.is_low, c.is_high, c.mask_stale_tokens) == (
        "tis",
        "token",
        0.5,
        5.0,
        False,
    )


@pytest.mark.parametrize(
    "data, key",
    [
        ({"is_correction": "ppo"}, "is_correction"),
        ({"is_level": "geometric"}, "is_level"),
        ({"is_correction": "icepop", "is_level": "sequence"}, "is_level"),
        ({"is_level": "sequence"}, "is_level"),
        ({"is_low": 0.0}, "is_low"),
        ({"is_low": 1.5}, "is_low"),
        ({"is_high": 0.9}, "is_high"),
        ({"mask_stale_tokens": "maybe"}, "mask_stale_tokens"),
    ],
)
def test_off_policy_config_rejects_bad_values_naming_the_key(data, key):
    with pytest.raises(ConfigError, match=key):
        from_dict(LossConfig, data)


def test_off_policy_config_from_yaml_values():
    c = from_dict(
        LossConfig, {"is_correction": "mis", "is_level": "sequence", "is_low": "0.25", "is_high": 4}
    )
    assert (c.is_correction, c.is_level, c.is_low, c.is_high, c.rejects_tokens) == (
        "mis",
        "sequence",
        0.25,
        4.0,
        True,
    )
    assert math.isclose(from_dict(LossConfig, {"is_correction": "icepop"}).is_high, 5.0)
