"""GRPO token loss (method §2): PPO clip on the token ratio with a sequence-level advantage.

All inputs are per token ``[T]`` (the sample's advantage broadcast to its tokens). The loss is not
reduced: the router masks it and divides by the global token count it is given.

Three policies, as in decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization"):
the target π_θ (differentiable), the proximal policy π_old — the trainer's own log-probs, scored once per
rollout batch before its first optimizer step (``trainer/passes/scoring.py``) — and the behaviour policy
π_rollout, the engine's log-probs of the sampled tokens. The PPO ratio and clip use π_θ / π_old; the
detached importance weight uses π_old / π_rollout (``tis_weight``, or ``losses/importance.py``).

On-policy (``rollout.off_policy_steps: 0``) this is the paper's objective exactly: π_old holds the weights
that generated the batch, so π_old / π_rollout differs from 1 only by the engine's numerics (kernels,
precision, MoE routing), and TIS with cap 2 is the paper's correction of that mismatch.

Off-policy (N > 0): π_rollout is up to N weight versions older than π_old (with partial rollouts, each
token its own version), so the importance weight now also corrects the behaviour-policy gap — TIS
truncates it, MIS / IcePop (``loss.is_correction``) mask tokens whose ratio left [is_low, is_high], and
``loss.mask_stale_tokens`` drops tokens beyond N versions instead. The clip still bounds the step from
π_old, the current weights, so a stale batch cannot move the policy further than an on-policy one.
Routing, advantages and teacher prompts are built from the completed group (whatever versions its members
came from), and the EMA teacher is scored at training time, like π_old: it is the trainer's current
teacher, not the one of the generating version.
"""

from __future__ import annotations

import torch

from srpo_megatron.losses.importance import clamped_exp

# The log-ratio log π_θ − log π_old is clamped to ±20 before exp, as verl (``compute_policy_loss_vanilla``)
# and SDPO's code do: in fp32 exp overflows above ~88.7, and an inf ratio makes the gradient NaN even
# where the clip selects the constant branch (0 · inf). e^20 ≈ 4.9e8 lies far outside any clip range, so
# values inside ±20 are unchanged bit for bit; beyond it the ratio is constant (no gradient through it).
LOG_RATIO_CLAMP = 20.0


def tis_weight(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, cap: float | None
) -> torch.Tensor | None:
    """Truncated importance weight min(π_old / π_rollout, cap), detached: [T] → [T] (None if disabled).

    The log-ratio is clamped to ±20 before exp (``importance.clamped_exp``), as every IS weight here."""
    if rollout_logp is None or cap is None:
        return None
    return clamped_exp(old_logp.detach() - rollout_logp.detach()).clamp(max=cap)


def importance_weight(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    cap: float | None,
    is_weight: torch.Tensor | None,
) -> torch.Tensor | None:
    """The importance weight of a token loss: ``is_weight`` when given, else TIS."""
    if is_weight is None:
        return tis_weight(old_logp, rollout_logp, cap)
    if rollout_logp is not None:
        raise ValueError("pass rollout_logp (TIS) or is_weight (a precomputed correction), not both")
    return is_weight.detach()


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    rollout_logp: torch.Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = 3.0,
    tis_cap: float | None = 2.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO loss [T] and per-token metrics (detached [T] tensors).

    logp:         [T] log π_θ(y_t), differentiable
    old_logp:     [T] log π_old(y_t) (scoring pass, constant)
    advantages:   [T] A_i of the token's sample
    rollout_logp: [T] log π_rollout(y_t) from the engine, for the truncated IS weight (optional)
    ref_logp:     [T] reference-policy log-probs for the k3 KL term (needed when kl_coef > 0)
    entropy:      [T] student entropy for the entropy bonus (needed when entropy_coef > 0)
    is_weight:    [T] a precomputed detached importance weight used instead of TIS (MIS / IcePop,
                  ``losses/importance.py``); give it or ``rollout_logp``, not both

    ℓ = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) with ρ = exp(clamp(log π_θ − log π_old, ±20)); for A < 0,
    ℓ = min(ℓ, −c·A) (dual clip); ℓ ·= w_TIS (or ``is_weight``); then + kl_coef·k3(π_ref, π_θ)
    − entropy_coef·H.
    """
    adv = advantages.detach().to(logp.dtype)
    log_ratio = (logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    surrogate = -ratio * adv
    clipped = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(surrogate, clipped)
    metrics = {"ratio": ratio.detach(), "clipped": (clipped > surrogate).to(logp.dtype)}
    if dual_clip is not None:
        capped = torch.minimum(loss, -dual_clip * adv)
        metrics["dual_clipped"] = ((adv < 0) & (loss > -dual_clip * adv)).to(logp.dtype)
        loss = torch.where(adv < 0, capped, loss)
    w = importance_weight(old_logp, rollout_logp, tis_cap, is_weight)
    if w is not None:
        loss = loss * w
        metrics["tis_weight"] = w
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (reference-policy log-probs of the sampled tokens)")
        delta = ref_logp.detach() - logp
        k3 = delta.exp() - delta - 1.0
        loss = loss + kl_coef * k3
        metrics["kl"] = k3.detach()
    if entropy_coef:
        if entropy is None:
            raise ValueError(
                "entropy_coef != 0 needs the student entropy (token_stats(..., with_entropy=True))"
            )
        loss = loss - entropy_coef * entropy
    return loss, metrics
