"""Multi-turn environments and their faults (``rollout/environments``, ``rollout/multi_turn.py``), through
the rank-0 path that builds ``Sample``s (``sample_routing.reward_groups`` / ``route_groups``).

The engine here is a stand-in (``ScriptedEngine``): a policy that writes the given assistant turns as
Qwen3 token ids (ending with ``<|im_end|>``), since the random tiny model never writes a tool call; the
token bookkeeping on the real tiny model is ``test_multi_turn_tokens.py``'s. Faults (a step that raises,
one that hangs past ``rollout.tool_timeout_s``, one that answers a huge output) each show as one
``multiturn/*`` count in the step's metrics, the trajectory is scored as ``rollout.on_tool_fault`` says
(continue: the error is the tool's answer; fail: reward 0), and nothing raises out of the step.
"""

from __future__ import annotations

import threading

import pytest

from srpo_megatron.config import ConfigError, LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import Completion, SamplingParams
from srpo_megatron.rollout.environments import EnvStep, NotAnEnvironment, resolve_environment
from srpo_megatron.rollout.environments.calculator import CalculatorEnv, evaluate
from srpo_megatron.rollout.environments.tool_replay import RECORDED_OK, ToolReplayEnv
from srpo_megatron.rollout.multi_turn import (
    MultiTurnRollout,
    Trajectory,
    TurnLimits,
    TurnRenderer,
    multi_turn_metrics,
)
from srpo_megatron.trainer.collect.sample_routing import reward_groups, route_groups

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
HANG = threading.Event()  # set at the end of the module: releases the hung environment's thread


class ScriptedEngine:
    """Stand-in engine: trajectory k's turn t is ``scripts[k][t]`` (k counts prompts × n in order)."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.calls = tok, scripts, 0
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.turn = {}  # trajectory key -> next turn

    def _completion(self, k, t, index, member=0):
        text = self.scripts[k][min(t, len(self.scripts[k]) - 1)]
        ids = [*encode_text(self.tok, text), self.eos]
        return Completion(index, ids, [-0.5] * len(ids), "stop", meta={"sample_index": member})

    def generate(self, prompts, params):
        self.order = {}
        out = []
        for i, _ in enumerate(prompts):
            group = []
            for j in range(params.n):
                k = i * params.n + j
                group.append(self._completion(k, 0, i, j))
                self.order[k] = 1
            out.append(group)
        return out

    def generate_requests(self, inputs, params):
        # the driver asks for the live trajectories in order; map each to its script by seed
        out = []
        for p in params:
            k = self.keys[p.seed]
            out.append(self._completion(k, self.order[k], 0))
            self.order[k] += 1
        return out


def drive(env_factory, scripts, limits=None, answer="12", kind="arithmetic", max_new_tokens=2048):
    tok = qwen3_tokenizer()
    row = Row("What is 3 * 4?", None, answer, kind, "arith", "rows:1")
    prompt = encode_text(tok, template_text(tok, row.prompt, row.system))
    engine = ScriptedEngine(tok, scripts)
    params = SamplingParams(n=len(scripts), max_new_tokens=max_new_tokens, seed=7)
    driver = MultiTurnRollout(TurnRenderer(tok), env_factory, limits or TurnLimits())
    from srpo_megatron.rollout.base import sample_seed

    engine.keys = {sample_seed(7, 0, j): j for j in range(len(scripts))}
    out = driver.generate(engine, [prompt], [row], params)
    return tok, row, prompt, out


def batch(tok, row, prompt, out):
    prompts = [Prompt(tuple(prompt), row)]
    pool = RewardPool(0, 10.0)
    try:
        scores = reward_groups(tok, prompts, out, pool)
    finally:
        pool.close()
    return route_groups(tok, prompts, out, scores.texts, scores.rewards, LossConfig(), TeacherConfig())


def test_the_calculator_evaluates_by_walking_the_ast():
    assert [evaluate(e) for e in ("12*(3+4)", "7/2", "-2**3", "2**-1", "10 // 3 % 2")] == [
        "84",
        "3.5",
        "-8",
        "0.5",
        "1",
    ]
    for bad in ('__import__("os").system("true")', "x + 1", "(1).real", "2**1000", "1/0", "[1]"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_a_calculator_trajectory_becomes_one_masked_sample():
    scripts = [[CALC % "3 * 4", "The answer is 12."], ["I think it is 13."]]
    tok, row, prompt, out = drive(CalculatorEnv, scripts)
    good, direct = out[0]
    t = Trajectory.of(good)
    assert (t.turns, t.tool_calls, t.tool_errors, good.finish_reason) == (2, 1, 0, "stop")
    tool = [i for i, m in zip(good.token_ids, t.response_mask, strict=True) if m == 0]
    assert tok.decode(tool) == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    b = batch(tok, row, prompt, out)
    s_good, s_direct = b.samples
    assert s_good.response_mask == t.response_mask and s_direct.response_mask == [1] * len(direct.token_ids)
    assert (s_good.reward, s_direct.reward) == (1.0, 0.0)  # the verifier read the assistant turns only
    assert b.metrics["multiturn/tool_calls"] == 1 and b.metrics["multiturn/turns_mean"] == 1.5


def test_the_replay_environment_answers_recorded_calls_once():
    answer = (
        '[{"Action": "getFacts", "Action_Input": "{\\"limit\\": 2}", "Observation": "[\\"a\\", \\"b\\"]"}]'
    )
    env = ToolReplayEnv()
    env.reset(Row("q", None, answer, "tooluse", "tooluse", "t:1"))
    first = env.step('Thought: look\nAction: getFacts\nAction Input: {"limit": 2}')
    assert (
        first.messages == [{"role": "tool", "content": 'Observation: ["a", "b"]'}] and not first.tool_errors
    )
    again = env.step('Action: getFacts\nAction Input: {"limit": 2}')
    assert again.tool_errors == 1  # used up
    assert env.step("Final Answer: a and b").done
    env.reset(Row("q", None, '[{"Action": "ping", "Action_Input": "{}"}]', "tooluse", "tooluse", "t:2"))
    assert env.step("Action: ping\nAction Input: {}").messages[0]["content"] == f"Observation: {RECORDED_OK}"


class Raising:
    def reset(self, row):
        return []

    def step(self, text):
        if "<tool_call>" in text:
            raise RuntimeError("the tool's backend is down")
        return EnvStep(done=True)


class Hanging(Raising):
    def step(self, text):
        if "<tool_call>" in text:
            HANG.wait()
        return EnvStep(done=True)


class Huge(Raising):
    def step(self, text):
        if "<tool_call>" in text:
            return EnvStep([{"role": "tool", "content": "9 " * 200_000}], tool_calls=1)
        return EnvStep(done=True)


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    yield
    HANG.set()


FAULTS = [
    (Raising, "multiturn/tool_raised", "raised RuntimeError"),
    (Hanging, "multiturn/tool_timeouts", "past"),
]


@pytest.mark.parametrize(("env", "metric", "line"), FAULTS)
@pytest.mark.parametrize("on_fault", ["continue", "fail"])
def test_a_fault_is_counted_and_scored_as_the_recipe_says(env, metric, line, on_fault):
    scripts = [[CALC % "3 * 4", "The answer is 12."], ["12"]]
    limits = TurnLimits(tool_timeout_s=0.5, on_tool_fault=on_fault)
    tok, row, prompt, out = drive(env, scripts, limits)
    t = Trajectory.of(out[0][0])
    assert len(t.faults) == 1 and line in t.faults[0]
    b = batch(tok, row, prompt, out)
    assert b.metrics[metric] == 1
    assert b.metrics["multiturn/failed"] == (on_fault == "fail")
    faulted = b.samples[0]
    if on_fault == "continue":  # the error is the tool's answer, the model's final answer is scored
        tool = [i for i, m in zip(faulted.response_ids, faulted.response_mask, strict=True) if m == 0]
        assert "error: the environment's step" in tok.decode(tool) and t.turns == 2
        assert faulted.reward == 1.0
    else:
        assert t.turns == 1 and t.failed and faulted.reward == 0.0
    assert b.samples[1].reward == 1.0  # the sibling is untouched


def test_a_huge_tool_output_is_clipped_and_counted():
    _, _, _, out = drive(Huge, [[CALC % "1", "12"]], TurnLimits(max_tool_output_tokens=64))
    t = Trajectory.of(out[0][0])
    assert t.tool_clipped == 1 and t.turns == 2
    assert len(t.response_mask) - sum(t.response_mask) < 64 + 40  # the clip plus the template's markup
    assert multi_turn_metrics(out[0])["multiturn/tool_clipped"] == 1


def test_the_token_budget_and_max_turns_truncate():
    loop = [[CALC % "1 + 1"] * 10]
    _, _, _, out = drive(CalculatorEnv, loop, TurnLimits(max_turns=3))
    c = out[0][0]
    assert (c.finish_reason, Trajectory.of(c).truncated, Trajectory.of(c).turns) == (
        "length",
        "turns",
        3,
    )
    _, _, _, out = drive(CalculatorEnv, loop, TurnLimits(max_turns=10), max_new_tokens=120)
    c = out[0][0]
    assert (c.finish_reason, Trajectory.of(c).truncated) == ("length", "tokens") and len(c.token_ids) < 120
    assert multi_turn_metrics([c])["multiturn/truncated_tokens"] == 1


def test_environment_targets_are_checked_before_use():
    assert resolve_environment("srpo_megatron.rollout.environments.calculator:CalculatorEnv") is CalculatorEnv
    with pytest.raises(NotAnEnvironment, match="without \\['reset', 'step'\\]"):
        resolve_environment("collections:Counter")
    with pytest.raises(NotAnEnvironment, match="no arguments"):
        resolve_environment("os:system")
    with pytest.raises(ConfigError, match=r"rollout\.environment='calculator' must look like"):
        RolloutConfig(environment="calculator")
    with pytest.raises(ConfigError, match=r"routing_replay is not supported with rollout"):
        RolloutConfig(environment="m:f", routing_replay=True)


def test_the_bookkeeping_survives_the_pools_checkpoint_without_unpickling(tmp_path):
    import dataclasses

    import torch

    _, _, _, out = drive(CalculatorEnv, [[CALC % "3 * 4", "12"]])
    c = out[0][0]
    torch.save({"completion": {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}}, tmp_path / "b.pt")
    back = Completion(**torch.load(tmp_path / "b.pt", weights_only=True)["completion"])
    assert Trajectory.of(back) == Trajectory.of(c) and Trajectory.of(c).turns == 2


def test_planted_unguarded_step_lets_a_raising_tool_crash_the_rollout(monkeypatch):
    """The guard is what keeps the step alive: calling the environment directly (planted) raises out."""
    from srpo_megatron.rollout import multi_turn

    monkeypatch.setattr(multi_turn, "guarded_step", lambda env, text, timeout_s: (env.step(text), "", ""))
    with pytest.raises(RuntimeError, match="backend is down"):
        drive(Raising, [[CALC % "3 * 4", "12"]])
