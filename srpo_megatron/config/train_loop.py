"""The recipe's ``train`` section: steps and batching of the optimisation."""

from __future__ import annotations

from dataclasses import dataclass

from srpo_megatron.config.loading import ConfigError


@dataclass
class TrainLoopConfig:
    """Steps and batching of the optimisation."""

    steps: int = 100  # training steps (each: one rollout batch)
    mini_batches: int = 1  # optimizer steps per rollout batch (paper: SRPO/SDPO 1, GRPO 4)
    micro_batch_size: int = 4  # sequences per forward/backward micro-batch on each DP rank (unpacked)
    # > 0: pack sequences end to end (THD) into micro-batches of at most this many tokens (first-fit
    # decreasing) instead of micro_batch_size right-padded rows; 0 = off. Required for parallel.cp > 1.
    max_tokens_per_micro_batch: int = 0
    skip_nonfinite: bool = True  # skip (and count) a step whose loss or grad norm is NaN/inf
    eval_at_ends: bool = (
        False  # evaluate before the first and after the last step (eval.every_n_steps between)
    )
    eval_greedy: bool = True  # with each evaluation also report greedy accuracy (temperature 0, k = 1)
    # with eval_at_ends: also evaluate the starting weights (False: a study shares one step-0 evaluation)
    eval_at_start: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError(
                f"train.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0 "
                "(0 turns packing off)"
            )
        if self.steps < 0 or self.mini_batches < 1 or self.micro_batch_size < 1:
            raise ConfigError(
                f"train: steps={self.steps} >= 0, mini_batches={self.mini_batches} >= 1 and "
                f"micro_batch_size={self.micro_batch_size} >= 1 are required"
            )
