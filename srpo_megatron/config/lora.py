"""The recipe's ``lora`` section: low-rank adapters on the policy's linear layers (LoRA, Hu et al. 2021).

``rank: 0`` (the default) trains every weight. With ``rank > 0`` the base weights are frozen and only the
adapters train; the EMA self-teacher then keeps an EMA of the adapters alone (README "LoRA").
``target_modules`` use Hugging Face / PEFT module names, so an exported adapter folder loads with ``peft``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from srpo_megatron.config.loading import ConfigError

# The PEFT names a Megatron linear answers to: the fused QKV and gate/up linears carry one adapter per
# HF projection (q/k/v, gate/up), so the adapters are exactly PEFT's (no shared A across q, k and v).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# MLA (DeepSeek-V3) projections, by their HF names
LORA_MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


@dataclass
class LoraConfig:
    """Low-rank adapters ΔW = (alpha/rank)·B·A on the targeted linears; the base weights are frozen."""

    rank: int = 0  # r: 0 = no adapters (full fine-tuning)
    alpha: float = 32.0  # scaling alpha/r, as PEFT's default (no rsLoRA)
    dropout: float = 0.0  # dropout on the adapter's input (training passes only)
    # HF/PEFT module names that get adapters (attention and dense MLP by default)
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    experts: bool = False  # MoE: per-expert adapters on every routed expert's gate/up/down too
    sync: Literal["adapter", "merged"] = "adapter"  # engines get the adapters, or merged full weights

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank} must be >= 0 (0 turns LoRA off; typical: 8-64)")
        if self.rank and self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha} must be > 0 (the scaling is alpha/rank; PEFT: 8-32)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        known = LORA_TARGETS + LORA_MLA_TARGETS
        unknown = [t for t in self.target_modules if t not in known]
        if unknown:
            raise ConfigError(
                f"lora.target_modules has {unknown}, which no Megatron linear answers to; "
                f"use HF/PEFT names from {list(known)}"
            )
        if self.rank and not self.target_modules:
            raise ConfigError("lora.target_modules is empty with lora.rank > 0; name at least one module")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0
