"""Typed config of the prompt data (train prompts and evaluation benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ArithmeticTaskConfig:
    """The synthetic arithmetic task (``srpo_megatron.data.arithmetic``), generated instead of read."""

    # 0 = single-step "What is 7 + 5?"; 1 two-digit +/-; 2 mixed ops; 3 word problems; 4 = level 0 on 1..50
    difficulty: int = 0
    num_train: int = 2000  # training prompts to generate
    num_eval: int = 100  # held-out prompts (never overlapping the training problems)
    seed: int = 0  # generator seed; the train/held-out partition does not depend on it
    reasoning: bool = False  # "Think step by step, then give the final number." instead of the number only
    system: str | None = None  # the rows' system message (e.g. a tool's instructions); None = none

    def __post_init__(self) -> None:
        if not 0 <= self.difficulty <= 5:
            raise ValueError(
                f"arithmetic.difficulty={self.difficulty} is not valid; choose 0, 1, 2, 3, 4 or 5"
            )
        if self.num_train < 0 or self.num_eval < 0:
            raise ValueError("arithmetic.num_train and num_eval must be >= 0 (they count prompts)")
        if self.system is not None and not (isinstance(self.system, str) and self.system.strip()):
            raise ValueError(
                f"arithmetic.system={self.system!r} must be a non-empty string (the rows' system message), "
                "or null for none (the chat template's default)"
            )


@dataclass
class DataConfig:
    """Where prompts come from and how they are templated, filtered and shuffled."""

    train_files: list[str] = field(default_factory=list)  # JSONL/Parquet rows; relative to data_dir
    eval_files: list[str] = field(default_factory=list)  # one benchmark per file (name from its path)
    data_dir: str | None = None  # root of relative paths; None = $SRPO_DATA_DIR or <repo>/../shared/data
    arithmetic: ArithmeticTaskConfig | None = None  # use the synthetic task (adds to the files, if any)
    max_prompt_tokens: int = 2048  # templated prompt length limit (paper: 2048)
    overlong: Literal["drop", "truncate"] = "drop"  # what to do with longer prompts (both are counted)
    truncate_side: Literal["left", "right"] = "left"  # which end of the user message truncation cuts
    skip_bad_rows: bool = False  # skip malformed rows (counted) instead of raising
    shuffle: bool = True  # reshuffle the training prompts each epoch (deterministic from seed, epoch)
    seed: int = 0  # shuffle seed
    enable_thinking: bool = False  # passed to the chat template (Qwen3); the paper runs thinking off

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 8:
            raise ValueError(
                f"data.max_prompt_tokens={self.max_prompt_tokens} is too small to hold a chat-templated "
                "prompt; use the paper's 2048 or at least a few hundred tokens"
            )
        if not self.train_files and not self.eval_files and self.arithmetic is None:
            raise ValueError(
                "data: no prompts configured; set data.train_files / data.eval_files (JSONL or Parquet, "
                "e.g. sciknoweval/physics/train.jsonl) or data.arithmetic for the synthetic task"
            )
