"""Typed configuration of the SRPO objective (method §2); defaults are the paper's SRPO settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from srpo_megatron.config.loading import ConfigError

Mode = Literal[
    "srpo", "grpo", "sdpo", "srpo_no_dw", "sdpo_incorrect_only", "sdpo_correct_only", "advantage_mix"
]
WeightScope = Literal["batch", "micro_batch"]
Aggregation = Literal["token_mean", "seq_mean_token_mean"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean")
ISCorrection = Literal["tis", "mis", "icepop"]
ISLevel = Literal["token", "sequence"]
IS_CORRECTIONS: tuple[str, ...] = ("tis", "mis", "icepop")
RejectionDenominator = Literal["drop", "keep"]
REJECTION_DENOMINATORS: tuple[str, ...] = ("drop", "keep")
MODES: tuple[str, ...] = (
    "srpo",
    "grpo",
    "sdpo",
    "srpo_no_dw",
    "sdpo_incorrect_only",
    "sdpo_correct_only",
    "advantage_mix",
)


@dataclass
class LossConfig:
    """Every knob of the routed GRPO + SDPO loss."""

    # srpo | grpo (all samples GRPO) | sdpo (paper's pure SDPO) | srpo_no_dw | advantage_mix (no routing)
    # | sdpo_incorrect_only / sdpo_correct_only (Fig. 1(b): pure SDPO on wrong / correct samples only)
    mode: Mode = "srpo"
    # reward at or above which a rollout counts as correct (c_i = 1[r_i >= threshold])
    success_threshold: float = 0.5
    # divide group advantages by the group's reward std (off = Dr. GRPO, the paper's setting)
    std_normalize: bool = False
    # added to the std before dividing, so all-equal groups do not divide by zero
    std_eps: float = 1e-6
    # PPO lower clip: ratio floor 1 − eps_low
    eps_low: float = 0.2
    # PPO upper clip (clip-higher): ratio ceiling 1 + eps_high
    eps_high: float = 0.28
    # dual-clip c for negative advantages (loss capped at −c·A); null disables it
    dual_clip: float | None = 3.0
    # truncated importance sampling cap on π_old / π_rollout (detached); null disables the correction
    tis_cap: float | None = 2.0
    # off-policy correction by ρ = π_old / π_rollout (losses/importance.py), exp of log ρ clamped to ±20:
    # tis = min(ρ, tis_cap) (the paper's); mis = masked IS: ρ inside [is_low, is_high] weights the token by
    # ρ, outside it is rejected (no loss; denominators per is_rejection_denominator); icepop = ρ inside
    # [is_low, is_high], else weight 0 (the token stays in every denominator)
    is_correction: ISCorrection = "tis"
    # mis only: the ratio the bounds test: each token's ρ_t, or the sequence's ρ = exp(Σ_t log ρ_t)
    is_level: ISLevel = "token"
    # mis / icepop: lower bound on ρ = π_old/π_rollout (IcePop's α); slime's tis_lower_bound is the same
    # ratio; verl's token_k1 / seq_sum_k1 bound the inverse π_rollout/π_old: [a, b] here = verl "1/b_1/a"
    is_low: float = 0.5
    # mis / icepop: upper bound on ρ = π_old/π_rollout (IcePop's β); the default [0.5, 5] is verl's
    # rollout_rs_threshold "0.2_2.0" (verl's "0.5_5.0" is is_low 0.2, is_high 2 here)
    is_high: float = 5.0
    # mis only: what a rejected token does to N_tokens, |y_i|, N_seq, |Ω_sdpo| and Σ w̃: drop = leaves them
    # (verl, which clears it from response_mask); keep = stays in them with zero loss (slime, miles)
    is_rejection_denominator: RejectionDenominator = "drop"
    # drop tokens generated more than rollout.off_policy_steps weight versions before the trainer's from
    # the loss and from every denominator (whatever is_rejection_denominator), instead of weighting them
    mask_stale_tokens: bool = False
    # coefficient of the k3 KL-to-reference penalty (needs reference log-probs when > 0)
    kl_coef: float = 0.0
    # coefficient of the student entropy bonus (loss −= coef·H)
    entropy_coef: float = 0.0
    # student top-K ids per SDPO token (plus one tail bucket)
    top_k: int = 100
    # generalized JSD α over the K+1 buckets: 0 = KL(Q‖P) forward, 1 = KL(P‖Q) reverse, else JSD
    divergence_alpha: float = 0.5
    # detached cap on the current/old ratio that multiplies the SDPO token loss
    sdpo_ratio_cap: float = 2.0
    # dynamic-weighting sharpness: w̃ = exp(−β·H_teacher)
    beta: float = 1.0
    # where the mean of w̃ is taken: the whole training batch (all micro-batches and DP) or each micro-batch
    weight_scope: WeightScope = "batch"
    # how token losses become L: token_mean = Σ_{i,t} ℓ / N_tokens over the whole batch (the paper's
    # equations; SRPO's setting); seq_mean_token_mean = the mean over sequences of each sequence's token
    # mean (what SDPO's and verl's code does at micro-batch 1: the paper's GRPO / SDPO baseline runs)
    aggregation: Aggregation = "token_mean"
    # advantage_mix only: A = λ·A_GRPO + (1 − λ)·A_SDPO
    adv_mix_lambda: float = 0.9
    # the sampling temperature (student and teacher logits are divided by it): not a recipe key, a
    # TrainConfig sets it from rollout.temperature; code building a LossConfig alone may pass it
    temperature: float = field(
        default=1.0,
        metadata={
            "derived": "the loss divides logits by the sampling temperature, so it is taken from "
            "rollout.temperature (one knob); remove loss.temperature and set rollout.temperature"
        },
    )
    # tokens per chunk in the vocab-parallel kernels (0 = sized automatically to a few tens of MiB)
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, why: str, fix: str) -> ConfigError:
            return ConfigError(f"loss.{key}={getattr(self, key)!r}: {why}; {fix}")

        if self.mode not in MODES:
            raise bad("mode", "unknown objective", f"choose one of {list(MODES)}")
        if self.aggregation not in AGGREGATIONS:
            raise bad("aggregation", "unknown loss aggregation", f"choose one of {list(AGGREGATIONS)}")
        if self.weight_scope not in ("batch", "micro_batch"):
            raise bad("weight_scope", "unknown scope", "choose 'batch' (paper) or 'micro_batch'")
        if not 0.0 <= self.eps_low < 1.0:
            raise bad(
                "eps_low", "the ratio floor 1 − eps_low must stay positive", "use 0 <= eps_low < 1 (0.2)"
            )
        if self.eps_high < 0.0:
            raise bad("eps_high", "a negative clip would exclude ratio 1", "use eps_high >= 0 (0.28)")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise bad(
                "dual_clip",
                "dual-clip must exceed 1 to leave the PPO region intact",
                "use c > 1 (3.0) or null",
            )
        if self.is_correction not in IS_CORRECTIONS:
            raise bad(
                "is_correction", "unknown off-policy correction", f"choose one of {list(IS_CORRECTIONS)}"
            )
        if self.is_level not in ("token", "sequence"):
            raise bad("is_level", "unknown ratio level", "choose 'token' or 'sequence'")
        if self.is_level == "sequence" and self.is_correction != "mis":
            raise bad(
                "is_level",
                f"a sequence-level ratio is only defined for is_correction: mis, not {self.is_correction!r} "
                "(TIS as in the paper and IcePop weight each token)",
                "set loss.is_level: token, or loss.is_correction: mis",
            )
        if self.is_rejection_denominator not in REJECTION_DENOMINATORS:
            raise bad(
                "is_rejection_denominator",
                "unknown treatment of MIS-rejected tokens in the loss denominators",
                f"choose one of {list(REJECTION_DENOMINATORS)} (drop = verl, keep = slime / miles)",
            )
        if self.is_rejection_denominator != "drop" and self.is_correction != "mis":
            raise bad(
                "is_rejection_denominator",
                f"only is_correction: mis rejects tokens by their ratio, not {self.is_correction!r}",
                "remove loss.is_rejection_denominator, or set loss.is_correction: mis",
            )
        if not 0.0 < self.is_low <= 1.0:
            raise bad(
                "is_low",
                "the lower bound on π_old/π_rollout must be positive and admit ratio 1 (an on-policy token)",
                "use 0 < is_low <= 1 (0.5)",
            )
        if self.is_high < 1.0:
            raise bad(
                "is_high",
                "the upper bound on π_old/π_rollout must admit ratio 1 (an on-policy token)",
                "use is_high >= 1 (5.0)",
            )
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise bad("tis_cap", "the importance weight cap must be positive", "use a cap > 0 (2.0) or null")
        if self.kl_coef < 0.0:
            raise bad("kl_coef", "a negative KL coefficient rewards drifting from the reference", "use >= 0")
        if self.top_k < 1:
            raise bad("top_k", "SDPO needs at least one top-K bucket", "use top_k >= 1 (100)")
        if not 0.0 <= self.divergence_alpha <= 1.0:
            raise bad(
                "divergence_alpha", "α interpolates between forward and reverse KL", "use 0 <= α <= 1 (0.5)"
            )
        if self.sdpo_ratio_cap <= 0.0:
            raise bad("sdpo_ratio_cap", "the ratio cap must be positive", "use a cap > 0 (2.0)")
        if self.beta < 0.0:
            raise bad(
                "beta", "β < 0 would up-weight uncertain teacher tokens", "use β >= 0 (1.0; 0 = uniform)"
            )
        if not 0.0 <= self.adv_mix_lambda <= 1.0:
            raise bad("adv_mix_lambda", "λ mixes two advantages convexly", "use 0 <= λ <= 1 (0.9)")
        if self.temperature <= 0.0:
            raise bad("temperature", "logits are divided by it", "use the rollout temperature (> 0, 1.0)")
        if self.std_eps < 0.0:
            raise bad("std_eps", "it is added to a standard deviation", "use a small value >= 0 (1e-6)")
        if self.chunk_tokens < 0:
            raise bad("chunk_tokens", "it is a number of tokens", "use 0 (automatic) or a positive count")

    @property
    def rejects_tokens(self) -> bool:
        """Whether the off-policy correction rejects tokens from the loss (``losses.apply_rejections``)."""
        return self.is_correction == "mis" or self.mask_stale_tokens

    @property
    def uses_dynamic_weights(self) -> bool:
        """Only full SRPO weights SDPO tokens by teacher entropy."""
        return self.mode == "srpo"
