"""Typed config of evaluation (avg@k on the held-out benchmarks, as the paper validates)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    """How evaluation samples and scores; defaults are the paper's validation settings."""

    k: int = 16  # samples per prompt; avg@k is the mean reward over them
    temperature: float = 0.6  # sampling temperature (paper: 0.6)
    top_p: float = 0.95  # nucleus sampling (paper: 0.95)
    max_new_tokens: int = 8192  # response length limit (paper: 8192)
    seed: int = 1234  # sampling seed, so two evaluations of the same weights draw the same samples
    every_n_steps: int = 0  # evaluate during training every N steps (0 = only when asked)
    prompts_per_call: int = 64  # prompts sent to the engine per generate call
    max_prompts_per_benchmark: int | None = None  # evaluate only the first N prompts of each (None = all)
    budgets_hours: list[float] = field(default_factory=lambda: [1.0, 5.0, 10.0])  # wall-clock report budgets
    reward_workers: int = 2  # reward worker processes (0 = score on threads of the calling process)
    reward_timeout_s: float = 10.0  # per-sample reward timeout; a timeout scores 0 and is counted

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"eval.k={self.k} must be >= 1 (the paper uses 16 samples per prompt)")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p={self.top_p} must be in (0, 1] (1 = no nucleus truncation)")
        if self.max_new_tokens < 1 or self.prompts_per_call < 1:
            raise ValueError("eval.max_new_tokens and eval.prompts_per_call must be >= 1")
        if self.max_prompts_per_benchmark is not None and self.max_prompts_per_benchmark < 1:
            raise ValueError("eval.max_prompts_per_benchmark must be >= 1, or null for every prompt")
        if self.every_n_steps < 0 or self.reward_workers < 0 or self.reward_timeout_s <= 0:
            raise ValueError(
                f"eval.every_n_steps={self.every_n_steps} and eval.reward_workers={self.reward_workers} "
                f"must be >= 0, eval.reward_timeout_s={self.reward_timeout_s} > 0"
            )
        if any(b <= 0 for b in self.budgets_hours):
            raise ValueError(f"eval.budgets_hours={self.budgets_hours} must be positive hours")
