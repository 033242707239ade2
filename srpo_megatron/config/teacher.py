"""The recipe's ``teacher`` section: the SDPO self-teacher (method §1.4–1.5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from srpo_megatron.config.loading import ConfigError


@dataclass
class TeacherConfig:
    """The self-teacher of SDPO (method §1.4–1.5)."""

    kind: Literal["ema", "frozen", "trust_region"] = "ema"  # EMA of the student / initial model / mix
    ema_alpha: float = (
        0.05  # θ′ ← (1−α)θ′ + αθ after each step; trust_region: log q = (1−α)log q_ref + α log q_θ
    )
    max_prompt_tokens: int = 4096  # teacher prompt (with the sibling's solution) truncated from the right
    # the teacher's user turn (method §1.4); {user_prompt} and {sibling_response} are filled in
    solution_template: str = (
        "{user_prompt}\nCorrect solution:\n\n{sibling_response}\n\nCorrectly solve the original question."
    )

    # the chat template's enable_thinking for the teacher's prompt (the paper runs thinking off; Qwen3's
    # template then opens the reply with an empty think block, as for the student)
    enable_thinking: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema_alpha <= 1.0:
            raise ConfigError(f"teacher.ema_alpha={self.ema_alpha} must be in [0, 1] (paper: 0.05)")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"teacher.max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        for key in ("{user_prompt}", "{sibling_response}"):
            if key not in self.solution_template:
                raise ConfigError(f"teacher.solution_template must contain {key}")
