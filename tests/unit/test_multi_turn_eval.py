"""``srpo eval`` on a multi-turn benchmark: ``evaluate`` with ``multi_turn`` drives each sample through the
same ``MultiTurnRollout`` as training's rollouts (``rollout.environment``), on a few arithmetic rows with the
calculator, the tiny Qwen3 and the CPU engine. avg@k is the mean of the trajectories' rewards: the verifier
on the assistant turns (never the tool's words) plus the environment's reward parts.

Stand-ins, because a random model writes neither ``<|im_end|>`` nor tool calls: a seeded eighth of the
vocabulary joins the stop ids, and ``ScriptedCalculator`` is the real ``CalculatorEnv`` fed a scripted
call after the engine's first turn (then the engine's text alone: no call, done).
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

import pytest
import torch

from srpo_megatron.config import ArithmeticTaskConfig, DataConfig
from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.evaluation import avg_at_k
from srpo_megatron.evaluation.avg_at_k import build_eval_benchmarks, evaluate
from srpo_megatron.rewards import RewardPool
from srpo_megatron.rollout.environments.calculator import CalculatorEnv
from srpo_megatron.rollout.hf_engine import HFEngine
from srpo_megatron.rollout.multi_turn import MultiTurnRollout, TurnLimits, TurnRenderer
from srpo_megatron.testing.tiny import write_tiny_qwen3

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'
K = 2


class ScriptedCalculator(CalculatorEnv):
    """The calculator, its first turn answered as if the engine's text ended with ``CALL`` (reward 0.25)."""

    def reset(self, row):
        self.turn = 0
        return super().reset(row)

    def step(self, assistant_text):
        self.turn += 1
        step = super().step(assistant_text + (CALL if self.turn == 1 else ""))
        return dataclasses.replace(step, reward=0.25 if self.turn == 1 else 0.0)


def last_number_reward(response: str, answer: str) -> float:
    """Independent re-scoring of an arithmetic row: the last number of the response."""
    numbers = re.findall(r"-?[\d,]*\d(?:\.\d+)?", response)
    try:
        return float(bool(numbers) and Fraction(numbers[-1].replace(",", "")) == Fraction(answer))
    except (ValueError, ZeroDivisionError):
        return 0.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mt_eval")
    engine = HFEngine(
        AutoModelForCausalLM.from_pretrained(write_tiny_qwen3(root / "qwen3"), dtype=torch.float32)
    )
    tok = qwen3_tokenizer()
    data = DataConfig(arithmetic=ArithmeticTaskConfig(difficulty=0, num_eval=3), max_prompt_tokens=256)
    benches = build_eval_benchmarks(data, tok)
    g = torch.Generator().manual_seed(0)
    stops = tuple(int(t) for t in torch.randperm(len(tok), generator=g)[: len(tok) // 8])
    driver = MultiTurnRollout(TurnRenderer(tok), ScriptedCalculator, TurnLimits(max_turns=3))
    real = avg_at_k.SamplingParams
    avg_at_k.SamplingParams = lambda **kw: real(**{**kw, "stop_token_ids": (*kw["stop_token_ids"], *stops)})
    try:
        with RewardPool(num_workers=0) as pool:
            summary = evaluate(
                engine,
                benches,
                tok,
                root / "out",
                k=K,
                max_new_tokens=96,
                reward_pool=pool,
                multi_turn=driver,
            )
    finally:
        avg_at_k.SamplingParams = real
    import json

    samples = [json.loads(line) for line in (root / "out" / avg_at_k.SAMPLES_FILE).read_text().splitlines()]
    return summary, samples


def test_avg_at_k_over_trajectories_scores_the_assistant_turns_plus_the_environment(run):
    summary, samples = run
    assert len(samples) == 3 * K
    for s in samples:
        assert s["turns"] == 2 and s["tool_calls"] == 1 and s["env_reward"] == 0.25
        assert "<tool_response>" not in s["response"]
        assert s["reward"] == last_number_reward(s["response"], s["answer"]) + 0.25
    rewards = [s["reward"] for s in samples]
    (bench,) = summary["benchmarks"].values()
    assert bench["avg_at_k"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
    mt = summary["multi_turn"]
    assert mt["multiturn/tool_calls"] == 3 * K and mt["multiturn/turns_mean"] == 2.0
    assert 0.0 < mt["multiturn/tool_token_frac"] < 1.0
