"""The scripted-calculator scaffold of the multi-turn training tests (``tests/integration/
test_train_multi_turn.py`` and ``test_true_on_policy.py``, ``tests/dist/test_partial_multi_turn.py``): a
random tiny model writes neither ``<|im_end|>`` nor tool calls, so

- :class:`ScriptedCalculator` is the real ``CalculatorEnv`` fed a scripted ``<tool_call>`` after the
  engine's text on the first two turns (a model that calls the calculator twice, then answers);
- :func:`seeded_stop_ids` is a seeded eighth of the vocabulary as stop ids, so that turns end.
"""

from __future__ import annotations

from srpo_megatron.rollout.environments.calculator import CalculatorEnv

ENV = "tests.helpers.scripted_calculator:ScriptedCalculator"
CALLS = [
    '{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}',
    '{"name": "calc", "arguments": {}}',
]


class ScriptedCalculator(CalculatorEnv):
    """Stand-in for a model that calls the calculator: turn k <= 2 is answered as if it ended with CALLS[k]
    (the second names an unknown tool: a tool error); turn 3 is the engine's text alone (no call: done)."""

    def reset(self, row):
        self.turn = 0
        return super().reset(row)

    def step(self, assistant_text):
        self.turn += 1
        if self.turn <= len(CALLS):
            assistant_text += f"<tool_call>\n{CALLS[self.turn - 1]}\n</tool_call>"
        return super().step(assistant_text)


def multi_turn_rank(rank, world, overrides, drop_mask=False):
    """One trainer rank with the seeded stop ids (and, for the planted bug, ``route_groups`` dropping the
    rollout's mask: every multi-turn sample trained as single-turn)."""
    import dataclasses

    import torch

    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.train import train
    from srpo_megatron.trainer.collect import rollout_service, sample_routing
    from tests.helpers.recipe import RECIPE

    cfg = load_config(TrainConfig, str(RECIPE), overrides)
    vocab = len(load_tokenizer(cfg.model.hf_dir))
    g = torch.Generator().manual_seed(0)
    stops = tuple(int(t) for t in torch.randperm(vocab, generator=g)[: vocab // 8])
    real = rollout_service.sampling_params
    rollout_service.sampling_params = lambda *a, **k: dataclasses.replace(real(*a, **k), stop_token_ids=stops)
    if drop_mask:
        sample_routing.completion_mask = lambda completion: None
    return train(cfg)
