"""Scripted environments for the multi-turn driver tests against SGLang's request classes."""

from __future__ import annotations

from srpo_megatron.rollout.environments.base import EnvStep


class ThreeTurns:
    """A tool answer after each of the first two turns, then done."""

    def reset(self, row):
        self.turn = 0
        return []

    def step(self, text):
        self.turn += 1
        if self.turn >= 3:
            return EnvStep(done=True)
        return EnvStep([{"role": "tool", "content": f"result {self.turn}: 42"}], tool_calls=1)
