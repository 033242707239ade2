"""The recipe's ``performance`` section: GPU speed choices (what each resolves to: models/performance.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from srpo_megatron.config.loading import ConfigError

# Submodules megatron-core's selective recompute takes (TransformerConfig.recompute_modules, 0.16.1):
# core_attn, layernorm, mlp (a dense layer's MLP), moe (the whole MoE layer, router included: replayed in
# the recompute by compat/router_replay.py), moe_act (the experts' activation only; needs grouped GEMM).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act")


@dataclass
class PerformanceConfig:
    """Speed choices (recipe section ``performance``); ``auto`` = on when this machine can (module doc)."""

    layer_spec: Literal["auto", "te", "local"] = "auto"  # auto = Transformer Engine's when it imports
    fusions: Literal["auto", "off"] = "auto"  # auto = grad-accum / RoPE / bias-activation where available
    overlap_comm: Literal["auto", "on", "off"] = "auto"  # overlap grad reduce / param gather (dist. optim.)
    recompute: Literal["none", "selective", "full"] = "none"  # activation recompute granularity
    recompute_method: Literal["uniform", "block"] = "uniform"  # full: layers per chunk / first N per stage
    recompute_num_layers: int = 1  # full: layers per recompute chunk (uniform) or recomputed layers (block)
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective: submodules
    # The output layer fused into the loss kernels (ops/fused_output.py): the last stage never builds the
    # [T, V/TP] logits in the scoring, teacher and training passes. auto = on; off = materialised logits.
    fused_output: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        if self.recompute_num_layers < 1:
            raise ConfigError(
                f"performance.recompute_num_layers={self.recompute_num_layers} must be >= 1 (layers per "
                "recompute chunk for method uniform, layers recomputed per stage for method block)"
            )
        bad = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
        if bad or (self.recompute == "selective" and not self.recompute_modules):
            raise ConfigError(
                f"performance.recompute_modules={self.recompute_modules}: choose a non-empty subset of "
                f"{list(RECOMPUTE_MODULES)} (core_attn is the usual choice)"
            )
