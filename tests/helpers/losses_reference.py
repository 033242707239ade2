"""Float64 naive references for the vocab-parallel ops and the SRPO losses (test support, no tests).

Written independently of ``srpo_megatron``: full-vocabulary softmax on materialised [T, V] tensors,
probability-space divergences, per-token Python loops with explicit branches for the clipping rules
and per-sample loops for routing. Used by the unit tests and the gloo (TP / DP) tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (norm-wise relative error; b is the reference)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def ref_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    z = logits.double() / temperature
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def ref_logp(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    lp = ref_log_softmax(logits, temperature)
    if ids.dim() == logits.dim() - 1:
        return lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return lp.gather(-1, ids)


def ref_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    p = torch.softmax(logits.double() / temperature, dim=-1)
    return -(p * torch.log(p)).sum(-1)


def ref_topk(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by value descending, equal values by ascending id (a stable sort)."""
    lp = ref_log_softmax(logits, temperature)
    order = torch.sort(lp.detach(), dim=-1, descending=True, stable=True).indices[..., :k]
    return lp.gather(-1, order), order


def ref_bucket_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Probabilities of the K+1 buckets [T, K+1]: each id, then the summed mass of all other ids."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    outside = torch.ones_like(p, dtype=torch.bool).scatter(-1, ids, False)
    return torch.cat([p.gather(-1, ids), (p * outside).sum(-1, keepdim=True)], dim=-1)


def ref_divergence(p: torch.Tensor, q: torch.Tensor, alpha: float) -> torch.Tensor:
    """method §2 divergence between bucket probabilities p (student) and q (teacher): [T, B] → [T]."""
    if alpha == 0.0:
        return (q * torch.log(q / p)).sum(-1)
    if alpha == 1.0:
        return (p * torch.log(p / q)).sum(-1)
    m = (1 - alpha) * p + alpha * q
    return (1 - alpha) * (p * torch.log(p / m)).sum(-1) + alpha * (q * torch.log(q / m)).sum(-1)


@dataclass
class RefCfg:
    mode: str = "srpo"
    success_threshold: float = 0.5
    std_normalize: bool = False
    std_eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = 3.0
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    top_k: int = 4
    divergence_alpha: float = 0.5
    sdpo_ratio_cap: float = 2.0
    beta: float = 1.0
    adv_mix_lambda: float = 0.9
    temperature: float = 1.0
    is_correction: str = "tis"
    is_level: str = "token"
    is_low: float = 0.5
    is_high: float = 5.0
    mask_stale_tokens: bool = False
    aggregation: str = "token_mean"
    is_rejection_denominator: str = "drop"


def ref_clamped_exp(log_ratio: float) -> float:
    """exp of a log-ratio held within ±20 (the IS weights' overflow guard)."""
    return math.exp(min(max(log_ratio, -20.0), 20.0))


def ref_grpo_token(logp, old, adv: float, rollout, cfg: RefCfg, ref=None, ent=None, is_weight=None):
    """One token's GRPO loss with the PPO / dual-clip rules spelled out as branches.

    ``is_weight`` (a float) replaces the TIS weight (the MIS / IcePop corrections)."""
    ratio = torch.exp(logp - old)
    lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
    clipped_ratio = torch.clamp(ratio, lo, hi)
    loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if adv < 0 and cfg.dual_clip is not None and float(loss.detach()) > cfg.dual_clip * -adv:
        loss = torch.zeros_like(loss) + cfg.dual_clip * -adv
    if is_weight is not None:
        loss = loss * is_weight
    elif rollout is not None and cfg.tis_cap is not None:
        loss = loss * min(ref_clamped_exp(float(old) - float(rollout)), cfg.tis_cap)
    if cfg.kl_coef:
        d = ref - logp
        loss = loss + cfg.kl_coef * (torch.exp(d) - d - 1)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * ent
    return loss


def ref_route(rewards: list[list[float]], threshold: float):
    """Per-sample (correct, has_teacher, to_sdpo, sibling) by explicit loops."""
    out = []
    for group in rewards:
        row = []
        for i, r in enumerate(group):
            correct = r >= threshold
            sib = next((j for j, rj in enumerate(group) if j != i and rj >= threshold), -1)
            row.append((correct, sib >= 0, (not correct) and sib >= 0, sib))
        out.append(row)
    return out


def ref_off_policy(
    sample_of_token: list[int],
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cfg: RefCfg,
    stale: list[bool] | None = None,
) -> tuple[list[bool], list[float | None]]:
    """Per token: (kept, importance weight or None = the TIS rule) under the off-policy correction.

    Spelled out from the definitions: ρ = π_old / π_rollout per token, or per sequence the product of the
    sample's valid tokens' ratios; mis drops a token (or its whole sequence) whose ratio lies outside
    [is_low, is_high] and weights the others by ρ; icepop weights by ρ inside and 0 outside; stale tokens
    are dropped under mask_stale_tokens.
    """
    t_rows = len(sample_of_token)
    seq_log = {}
    for t in range(t_rows):
        if mask[t]:
            s = sample_of_token[t]
            seq_log[s] = seq_log.get(s, 0.0) + float(old_logp[t]) - float(rollout_logp[t])
    kept, weight = [], []
    for t in range(t_rows):  # a stale token still counts in its sequence's ratio (seq_log above)
        keep, w = bool(mask[t]), None
        if cfg.is_correction in ("mis", "icepop"):
            log_rho = (
                seq_log.get(sample_of_token[t], 0.0)
                if cfg.is_level == "sequence"
                else (float(old_logp[t]) - float(rollout_logp[t]))
            )
            rho = ref_clamped_exp(log_rho)
            inside = cfg.is_low <= rho <= cfg.is_high
            if cfg.is_correction == "mis":
                keep, w = keep and inside, rho
            else:
                w = rho if inside else 0.0
        if cfg.mask_stale_tokens and stale is not None and stale[t]:
            keep = False
        kept.append(keep)
        weight.append(w)
    return kept, weight


def ref_counted(
    mask: torch.Tensor, kept: list[bool], cfg: RefCfg, stale: list[bool] | None = None
) -> list[bool]:
    """Per token: whether it counts in the denominators. ``drop``: the kept tokens only; ``keep`` (MIS): every
    valid token but the stale ones (an MIS-rejected token counts, with no loss)."""
    if cfg.is_correction != "mis" or cfg.is_rejection_denominator == "drop":
        return list(kept)
    drop_stale = cfg.mask_stale_tokens and stale is not None
    return [bool(mask[t]) and not (drop_stale and stale[t]) for t in range(len(kept))]


def ref_routed_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    rewards: list[list[float]],
    sample_of_token: list[int],
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cfg: RefCfg,
    ref_logp: torch.Tensor | None = None,
    scope_of_token: list[int] | None = None,
    stale: list[bool] | None = None,
) -> torch.Tensor:
    """The method §2 objective for a whole batch: student_logits [T, V] fp64 (grad flows), teacher [T, V].

    ``scope_of_token`` (optional) assigns each token to a micro-batch for micro-batch-scope weights.
    ``stale`` (optional) marks each token stale (dropped under ``cfg.mask_stale_tokens``). Tokens the
    off-policy correction drops (``ref_off_policy``) are left out of every sum and count.
    """
    kept, is_weight = ref_off_policy(sample_of_token, mask, old_logp, rollout_logp, cfg, stale)
    counted = ref_counted(mask, kept, cfg, stale)
    g = len(rewards[0])
    routes = ref_route(rewards, cfg.success_threshold)
    flat = [routes[s // g][s % g] for s in range(len(rewards) * g)]
    adv = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5 if len(group) > 1 else 0.0
        adv += [(r - mean) / (std + cfg.std_eps) if cfg.std_normalize else r - mean for r in group]
    lp_s = ref_log_softmax(student_logits, cfg.temperature)
    lp_t = ref_log_softmax(teacher_logits, cfg.temperature)
    h_t = ref_entropy(teacher_logits, cfg.temperature)
    ent_s = ref_entropy(student_logits, cfg.temperature)
    _, top_ids = ref_topk(student_logits.detach(), cfg.top_k, cfg.temperature)
    t_rows = len(sample_of_token)

    def routes_of(s):
        _correct, has_teacher, to_sdpo, _ = flat[s]
        if cfg.mode in ("srpo", "srpo_no_dw"):
            return (not to_sdpo), to_sdpo
        if cfg.mode in ("grpo", "advantage_mix"):
            return True, False
        if cfg.mode == "sdpo_incorrect_only":
            return False, (not _correct) and has_teacher
        if cfg.mode == "sdpo_correct_only":
            return False, _correct and has_teacher
        assert cfg.mode == "sdpo", cfg.mode
        return False, has_teacher

    sdpo_tokens = [t for t in range(t_rows) if counted[t] and routes_of(sample_of_token[t])[1]]
    w_raw = {t: math.exp(-cfg.beta * float(h_t[t])) for t in sdpo_tokens}
    scope = scope_of_token or [0] * t_rows
    mean_w = {}
    for sc in set(scope):
        vals = [w_raw[t] for t in sdpo_tokens if scope[t] == sc]
        mean_w[sc] = sum(vals) / len(vals) if vals else 1.0
    total = student_logits.new_zeros(())
    n_valid = 0
    seq_sum: dict[int, torch.Tensor] = {}  # sample -> Σ_t ℓ over its kept tokens
    seq_len: dict[int, int] = {}  # sample -> |y_i|, its counted tokens
    for t in range(t_rows):
        if not counted[t]:
            continue
        n_valid += 1
        s = sample_of_token[t]
        seq_sum.setdefault(s, student_logits.new_zeros(()))
        seq_len[s] = seq_len.get(s, 0) + 1
        if not kept[t]:  # keep: in every count, no loss
            continue
        before = total
        to_grpo, to_sdpo = routes_of(s)
        y = int(response_ids[t])
        logp = lp_s[t, y]
        if to_grpo:
            a = adv[s]
            if cfg.mode == "advantage_mix":
                a_sdpo = float(lp_t[t, y] - old_logp[t]) if flat[s][1] else 0.0
                a = cfg.adv_mix_lambda * a + (1 - cfg.adv_mix_lambda) * a_sdpo
            total = total + ref_grpo_token(
                logp,
                old_logp[t].double(),
                a,
                rollout_logp[t].double(),
                cfg,
                None if ref_logp is None else ref_logp[t].double(),
                ent_s[t],
                is_weight[t],
            )
        if to_sdpo:
            ids = top_ids[t : t + 1]
            p = ref_bucket_probs(student_logits[t : t + 1], ids, cfg.temperature)
            q = ref_bucket_probs(teacher_logits[t : t + 1], ids, cfg.temperature)
            d = ref_divergence(p, q, cfg.divergence_alpha)[0]
            ratio = min(math.exp(float(logp.detach()) - float(old_logp[t])), cfg.sdpo_ratio_cap)
            tis = is_weight[t]
            if tis is None:
                tis = min(ref_clamped_exp(float(old_logp[t]) - float(rollout_logp[t])), cfg.tis_cap)
            w = w_raw[t] / mean_w[scope[t]] if cfg.mode == "srpo" else 1.0
            total = total + d * ratio * tis * w
        seq_sum[s] = seq_sum[s] + (total - before)
    if cfg.aggregation == "seq_mean_token_mean":  # (1/N_seq) Σ_i (1/|y_i|) Σ_t ℓ_it, N_seq = samples kept
        return sum(seq_sum[i] / seq_len[i] for i in seq_sum) / len(seq_sum)
    assert cfg.aggregation == "token_mean", cfg.aggregation
    return total / n_valid
