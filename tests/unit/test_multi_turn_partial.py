"""Partial rollouts of multi-turn trajectories (``MultiTurnRollout.continue_partial``,
``rollout/multi_turn.py``): a weight sync aborts an assistant turn at decode step k; after the sync the
SAME turn is continued from prompt + the earlier turns + its k partial tokens (not restarted, not closed
and followed by a new turn), then the trajectory goes on.

The engine is a stand-in (``AbortingEngine``): a scripted policy with one script per weight version (the
random tiny model never writes a tool call), which, like a language model, continues the assistant turn
already in its input, and answers the first request of the chosen turn after k tokens with finish reason
``abort`` and those tokens, as SGLang answers a running request that ``/pause_generation`` (mode abort)
reached. The scripts of the two versions differ from their first token, so a turn restarted from scratch
or closed at the abort gives other ids. Two planted bugs (monkeypatched old behaviours) fail the check:
restarting the aborted turn from scratch, and closing it at the abort so that a new turn starts.
"""

from __future__ import annotations

import dataclasses

import pytest

from srpo_megatron.config import ConfigError, RolloutConfig, SGLangEngineConfig
from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.data.rows import Row
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.rollout import multi_turn
from srpo_megatron.rollout.base import Completion, SamplingParams, sample_seed
from srpo_megatron.rollout.environments.calculator import CalculatorEnv
from srpo_megatron.rollout.multi_turn import STATE_KEY, MultiTurnRollout, Trajectory, TurnLimits, TurnRenderer
from srpo_megatron.rollout.partial import segment_seed

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
# turn t of the policy at weight version v: two tool calls, then the answer
TEXTS = {
    0: ["First I multiply. " + CALC % "3 * 4", "Let me add one. " + CALC % "12 + 1", "The answer is 13."],
    1: ["Okay, multiplying: " + CALC % "3 * 4", "Adding one now: " + CALC % "12 + 1", "So it is 13."],
}
TOOL_ANSWERS = ["12", "13"]  # the calculator's answers to turns 0 and 1
BUDGET = 1024


class AbortingEngine:
    """Stand-in engine (module doc). ``abort_at = (turn, k)``: the first request for assistant turn
    ``turn`` (0-based) returns after ``k`` tokens, finish reason abort. ``version``: the weights served."""

    def __init__(self, tok, abort_at: tuple[int, int]):
        self.tok, self.abort_at, self.version = tok, abort_at, 0
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.scripts = {v: [[*encode_text(tok, t), self.eos] for t in ts] for v, ts in TEXTS.items()}
        self.opener = encode_text(tok, "<|im_start|>assistant\n")
        self.think = encode_text(tok, "<think>\n\n</think>\n\n")
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.aborted = False

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos,)

    def _where(self, ids: list[int]) -> tuple[int, list[int]]:
        """(assistant turn index, the turn's tokens already in the input)."""
        n = len(self.opener)
        starts = [i for i in range(len(ids) - n + 1) if ids[i : i + n] == self.opener]
        so_far = ids[starts[-1] + n :]
        if so_far[: len(self.think)] == self.think:
            so_far = so_far[len(self.think) :]
        return len(starts) - 1, so_far

    def _one(self, ids, params: SamplingParams, index: int, member: int) -> Completion:
        self.requests.append((list(ids), params))
        turn, so_far = self._where(list(ids))
        out = self.scripts[self.version][turn][len(so_far) :][: params.max_new_tokens]
        finish = "stop" if out and out[-1] == self.eos else "length"
        if turn == self.abort_at[0] and not self.aborted:
            out, finish, self.aborted = out[: self.abort_at[1]], "abort", True
        lp = -0.1 * (self.version + 1)
        return Completion(
            index, out, [lp] * len(out), finish, weight_version=self.version, meta={"sample_index": member}
        )

    def generate(self, prompts, params):
        return [[self._one(p, params, i, j) for j in range(params.n)] for i, p in enumerate(prompts)]

    def generate_requests(self, inputs, params):
        return [self._one(x, p, 0, 0) for x, p in zip(inputs, params, strict=True)]


def run(abort_at: tuple[int, int]):
    """One trajectory aborted at ``abort_at``, the sync (version 0 -> 1), then resumed."""
    tok = qwen3_tokenizer()
    row = Row("What is 3 * 4 + 1?", None, "13", "arithmetic", "arith", "rows:1")
    prompt = encode_text(tok, template_text(tok, row.prompt, row.system))
    engine = AbortingEngine(tok, abort_at)
    renderer = TurnRenderer(tok)
    driver = MultiTurnRollout(renderer, CalculatorEnv, TurnLimits(max_turns=4))
    params = SamplingParams(n=1, max_new_tokens=BUDGET, seed=7)
    first = driver.generate(engine, [prompt], [row], params)
    engine.version = 1  # the weight sync the abort was for
    done = driver.continue_partial(engine, [prompt], params, first)
    return tok, renderer, prompt, engine, first[0][0], done[0][0]


def check(abort_at: tuple[int, int]) -> None:
    """The resumed trajectory: turns before the aborted one by version 0, the aborted turn = its k version-0
    tokens + version 1's continuation of them, later turns by version 1; 3 turns, masks, log-probs,
    per-token versions, and the continuation request's body."""
    a, k = abort_at
    _, renderer, prompt, engine, aborted, done = run(abort_at)
    v0, v1 = engine.scripts[0], engine.scripts[1]
    turns = [v0[t] if t < a else v0[t][:k] + v1[t][k:] if t == a else v1[t] for t in range(3)]
    tools = [
        renderer.tool_turn_ids([{"role": "tool", "content": ans}], turns[t], t + 1)
        for t, ans in enumerate(TOOL_ANSWERS)
    ]
    before = [i for t in range(a) for i in turns[t] + tools[t]]  # the ids ahead of the aborted turn
    # the abort: the trajectory so far, the open turn counted, its state kept
    assert aborted.finish_reason == "abort" and STATE_KEY in aborted.meta, "the aborted turn stays open"
    assert aborted.token_ids == before + v0[a][:k]
    assert Trajectory.of(aborted).turns == a + 1 and Trajectory.of(aborted).turn_spans[-1] == (
        len(before),
        len(before) + k,
    )
    # the continuation request: the same turn, from prompt + earlier turns + its partial tokens
    cont_ids, cont_params = engine.requests[a + 1]
    assert cont_ids == prompt + before + v0[a][:k], "the aborted turn resumes from its own partial tokens"
    assert cont_params.max_new_tokens == BUDGET - len(before) - k
    assert cont_params.seed == segment_seed(sample_seed(7, 0, 0), 1) and cont_params.prompt_offset == a
    # the resumed trajectory
    want = [i for t in range(3) for i in turns[t] + (tools[t] if t < 2 else [])]
    assert done.finish_reason == "stop" and STATE_KEY not in done.meta
    assert done.token_ids == want, (
        "ids = earlier turns + tool turns + (partial tokens + continuation) + later"
    )
    t = Trajectory.of(done)
    assert t.turns == 3 and (t.tool_calls, t.tool_errors) == (2, 0), (
        "the turn count is unchanged by the abort"
    )
    spans, pos = [], 0
    for n in range(3):
        spans.append((pos, pos + len(turns[n])))
        pos += len(turns[n]) + (len(tools[n]) if n < 2 else 0)
    assert t.turn_spans == spans
    assert t.response_mask == [int(any(s <= p < e for s, e in spans)) for p in range(len(want))]
    split = len(before) + k  # tokens before it: version 0; after it: version 1
    assert done.token_versions == [0] * split + [1] * (len(want) - split)
    lps = [(-0.1 if p < split else -0.2) if m else 0.0 for p, m in enumerate(t.response_mask)]
    assert done.logprobs == pytest.approx(lps)
    assert len(engine.requests) == 4, "three turns, one of them in two segments"


@pytest.mark.parametrize("abort_at", [(0, 2), (1, 3), (2, 2)], ids=["turn1", "turn2", "turn3"])
def test_an_aborted_turn_resumes_the_same_turn_from_its_partial_tokens(abort_at):
    check(abort_at)


def test_planted_restart_from_scratch_fails_the_check(monkeypatch):
    """Planted: the aborted turn's partial tokens dropped, the turn regenerated from its start."""
    monkeypatch.setattr(multi_turn._State, "open_ids", lambda self: [])
    monkeypatch.setattr(multi_turn, "merge_segments", lambda first, cont, prompt_len: cont)
    with pytest.raises(AssertionError, match="resumes from its own partial tokens"):
        check((1, 3))


def test_planted_new_turn_after_the_abort_fails_the_check(monkeypatch):
    """Planted: the aborted turn closed at the abort as if it had ended; the environment answers it and a
    new turn starts."""
    monkeypatch.setattr(
        multi_turn, "settle", lambda c, params, eos: dataclasses.replace(c, finish_reason="stop")
    )
    with pytest.raises(AssertionError, match="the aborted turn stays open"):
        check((1, 3))


def test_an_abort_on_the_turns_last_step_settles_it_without_a_continuation():
    """SGLang checks its abort before the stop check: a turn aborted on the step it wrote its end-of-turn
    token had ended (``partial.settle``); the trajectory goes on in the same call."""
    tok = qwen3_tokenizer()
    engine = AbortingEngine(tok, (1, 10**6))  # the whole turn, then "abort"
    row = Row("What is 3 * 4 + 1?", None, "13", "arithmetic", "arith", "rows:1")
    prompt = encode_text(tok, template_text(tok, row.prompt, row.system))
    driver = MultiTurnRollout(TurnRenderer(tok), CalculatorEnv, TurnLimits(max_turns=4))
    (c,) = driver.generate(engine, [prompt], [row], SamplingParams(n=1, max_new_tokens=BUDGET, seed=7))[0]
    assert engine.aborted and c.finish_reason == "stop" and Trajectory.of(c).turns == 3
    assert len(engine.requests) == 3 and c.token_versions is None


def test_partial_is_accepted_with_an_environment_and_routing_replay_still_refused():
    env = "srpo_megatron.rollout.environments.calculator:CalculatorEnv"
    sglang = SGLangEngineConfig(model_path="m", weight_sync="distributed")
    separate = {"placement": "separate", "engine": "sglang", "engine_nodes": 1, "sglang": sglang}
    assert RolloutConfig(environment=env, partial=True, off_policy_steps=1, **separate).partial
    with pytest.raises(ConfigError, match=r"routing_replay is not supported with rollout\.environment"):
        RolloutConfig(environment=env, routing_replay=True)
