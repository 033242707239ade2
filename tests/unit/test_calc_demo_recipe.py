"""The CPU demo's calculator variant (``examples/smollm2_arith_calc_cpu.yaml``): the tool-less demo but for
the multi-turn keys, and what SmolLM2 actually sees and may send.

SmolLM2's chat template has no tool section, so the tool's instructions are the rows' system message
(``data.arithmetic.system``). With the real SmolLM2 tokenizer: every prompt (train and held-out) renders
that system message in place of the template's default one and fits ``data.max_prompt_tokens``; a call
written as the message shows, with the question's expression, is parsed by the real ``CalculatorEnv`` to the
right value; the tool turn renders as a ``tool`` turn followed by the next assistant opening; and prompt,
call, tool turn and an answer fit the response budget.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from srpo_megatron.config import ArithmeticTaskConfig, TrainConfig, load_config, to_dict
from srpo_megatron.data.assets import AssetMissing, smollm2_tokenizer
from srpo_megatron.data.dataset import build_datasets
from srpo_megatron.rollout.environments.calculator import CalculatorEnv
from srpo_megatron.rollout.multi_turn import TurnRenderer
from tests.helpers.flat_keys import flat

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO, CALC = EXAMPLES / "smollm2_arith_cpu.yaml", EXAMPLES / "smollm2_arith_calc_cpu.yaml"
# What the calculator variant changes; everything else (seed, data, steps, optimizer, loss) is the demo's.
CHANGED = {
    "run.dir",
    "data.arithmetic.system",
    "rollout.environment",
    "rollout.max_turns",
    "rollout.max_new_tokens",
    "eval.max_new_tokens",
    "teacher.max_prompt_tokens",
    "model.max_sequence_length",
}


def _cfg(path: Path) -> TrainConfig:
    return load_config(TrainConfig, str(path), [])


def test_the_calculator_demo_is_the_demo_but_for_the_multi_turn_keys():
    demo, calc = flat(to_dict(_cfg(DEMO))), flat(to_dict(_cfg(CALC)))
    changed = {k for k in demo.keys() | calc.keys() if demo.get(k) != calc.get(k)}
    assert changed == CHANGED
    assert calc["rollout.environment"] == "srpo_megatron.rollout.environments.calculator:CalculatorEnv"


def test_arithmetic_system_must_be_a_non_empty_string():
    with pytest.raises(ValueError, match=r"arithmetic.system='  ' must be a non-empty string"):
        ArithmeticTaskConfig(system="  ")


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return smollm2_tokenizer()
    except AssetMissing as e:
        pytest.skip(str(e))


def test_smollm2_sees_the_calculator_instructions_and_its_call_is_parsed(tokenizer):
    cfg = _cfg(CALC)
    system = cfg.data.arithmetic.system
    train, evals = build_datasets(cfg.data, tokenizer)
    assert len(train) == cfg.data.arithmetic.num_train and len(evals) == cfg.data.arithmetic.num_eval
    for prompt in [*train.prompts[:50], *evals.prompts]:
        text = tokenizer.decode(list(prompt.ids), skip_special_tokens=False)
        assert prompt.row.system == system
        assert text.startswith(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n")
        assert "SmolLM" not in text  # the template's default system message is replaced, not added to

    renderer = TurnRenderer(tokenizer)
    example = re.search(r"<tool_call>.*?</tool_call>", system).group(0)
    assert '"expression": "12 * 3"' in example
    for prompt in evals.prompts[:16]:
        expression = re.search(r"What is (.+?)\?", prompt.row.prompt).group(1)
        call = example.replace("12 * 3", expression) + "<|im_end|>"
        ids = tokenizer(call, add_special_tokens=False)["input_ids"]
        env = CalculatorEnv()
        assert env.reset(prompt.row) == []
        step = env.step(renderer.assistant_text(ids, stopped=True))
        assert (step.done, step.tool_calls, step.tool_errors) == (False, 1, 0)
        assert step.messages == [{"role": "tool", "content": prompt.row.answer}]
        tool_ids = renderer.tool_turn_ids(step.messages, ids, turn=1)
        rendered = tokenizer.decode(tool_ids, skip_special_tokens=False)
        assert rendered == f"\n<|im_start|>tool\n{prompt.row.answer}<|im_end|>\n<|im_start|>assistant\n"
        answer = tokenizer(f"{prompt.row.answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        assert len(ids) + len(tool_ids) + len(answer) <= cfg.rollout.max_new_tokens
        assert len(prompt.ids) + cfg.rollout.max_new_tokens <= cfg.model.max_sequence_length
