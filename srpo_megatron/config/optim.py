"""The recipe's ``optim`` section: AdamW with linear warm-up (method §4)."""

from __future__ import annotations

from dataclasses import dataclass

from srpo_megatron.config.loading import ConfigError


@dataclass
class OptimConfig:
    """AdamW with linear warm-up to a constant learning rate (method §4)."""

    lr: float = 5e-6  # peak (constant) learning rate; paper: GRPO 1e-6, SDPO 1e-5, SRPO 5e-6
    warmup_steps: int = 10  # linear warm-up steps from 0
    weight_decay: float = 0.01  # decoupled weight decay
    adam_beta1: float = 0.9  # AdamW β1
    adam_beta2: float = 0.999  # AdamW β2
    adam_eps: float = 1e-8  # AdamW ε
    clip_grad: float = 1.0  # global gradient-norm clip (0 = off)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or self.clip_grad < 0:
            raise ConfigError(
                f"optim: lr={self.lr} must be > 0, warmup_steps={self.warmup_steps} >= 0, "
                f"clip_grad={self.clip_grad} >= 0"
            )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name}={getattr(self, name)} must be in [0, 1) (0.9 / 0.999)")
        if self.adam_eps <= 0 or self.weight_decay < 0:
            raise ConfigError(
                f"optim.adam_eps={self.adam_eps} must be > 0 (1e-8) and optim.weight_decay="
                f"{self.weight_decay} >= 0"
            )
