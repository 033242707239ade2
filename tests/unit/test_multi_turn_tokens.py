"""Token identity of multi-turn rollouts (``rollout/multi_turn.py``) on the tiny Qwen3 with the packaged
Qwen3 tokenizer, under two chat templates: the project's Qwen3-style one (``data/assets.py``) and Qwen3's
official one (``tests/data/qwen3_official_chat_template.jinja``; its source is in ``tests/data/README.md``),
which renders a non-last assistant turn without the empty think block a last one gets.

For 50 seeded trajectories of 1–4 turns the ids the trainer would score (``Completion.token_ids``, the
``Sample.response_ids``) must equal the ids the engine generated, turn by turn, with the template's
rendering of the tool turns between them, and the engine must have been asked for turn k+1 with exactly
``prompt + those ids``. The reference here is built independently of the driver: the engine's calls are
recorded by a proxy, and the tool turns' text is cut out of ONE rendering of the whole final conversation
(assistant turns as placeholders). A planted re-tokenization of the whole conversation (decode, encode)
fails the check, and so does a template whose rendering of a tool turn depends on what precedes it
(``TemplateDrift``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from srpo_megatron.data.assets import qwen3_tokenizer
from srpo_megatron.data.rows import Row
from srpo_megatron.data.templating import encode_text, template_text
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.environments.base import EnvStep
from srpo_megatron.rollout.hf_engine import HFEngine
from srpo_megatron.rollout.multi_turn import (
    MultiTurnRollout,
    TemplateDrift,
    Trajectory,
    TurnLimits,
    TurnRenderer,
)
from srpo_megatron.testing.tiny import write_tiny_qwen3

EOS_TEXT = "<|im_end|>"
OFFICIAL = Path(__file__).resolve().parents[1] / "data" / "qwen3_official_chat_template.jinja"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def tokenizer(template):
    """The packaged Qwen3 tokenizer with the project's template or Qwen3's official one."""
    tok = qwen3_tokenizer()
    if template == "official":
        tok.chat_template = OFFICIAL.read_text()
    return tok


class ScriptedEnv:
    """Answers with 1 or 2 tool messages until the trajectory has the number of turns its first
    assistant turn's text picks (1–4); every tool message says which turn it answers."""

    def reset(self, row):
        self.row, self.wanted, self.turn = row, 0, 0
        return []

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            self.wanted = 1 + int(hashlib.sha256(text.encode()).hexdigest(), 16) % 4
        if self.turn >= self.wanted:
            return EnvStep(done=True)
        return EnvStep(tool_messages(self.row, self.turn), tool_calls=1)


def tool_messages(row, turn):
    n = 1 + turn % 2
    return [{"role": "tool", "content": f"{row.answer} × {turn}.{k} = {turn * 7 + k} 🧮"} for k in range(n)]


class Recorder:
    """The engine, with every call's inputs and outputs recorded."""

    def __init__(self, engine):
        self.engine, self.first, self.requests = engine, None, []

    def generate(self, prompts, params):
        out = self.engine.generate(prompts, params)
        self.first = [[list(c.token_ids) for c in g] for g in out]
        return out

    def generate_requests(self, inputs, params):
        out = self.engine.generate_requests(inputs, params)
        self.requests += [(list(i), c) for i, c in zip(inputs, out, strict=True)]
        return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))
    return HFEngine(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))


def rows(n):
    return [
        Row(
            f"What is {i} + {2 * i}? Use the calculator.",
            "You are helpful." if i % 2 else None,
            str(3 * i),
            "arithmetic",
            "arith",
            f"rows:{i}",
        )
        for i in range(n)
    ]


def stop_ids(vocab, share=8):
    """A seeded eighth of the vocabulary: the random tiny model ends its turns after ~8 tokens."""
    g = torch.Generator().manual_seed(0)
    return tuple(int(t) for t in torch.randperm(vocab, generator=g)[: vocab // share])


def run(engine, thinking, n_prompts=25, n=2, template="project"):
    tok = tokenizer(template)
    data = rows(n_prompts)
    prompts = [encode_text(tok, template_text(tok, r.prompt, r.system, thinking)) for r in data]
    params = SamplingParams(n=n, max_new_tokens=400, seed=1234, stop_token_ids=stop_ids(len(tok)))
    rec = Recorder(engine)
    driver = MultiTurnRollout(TurnRenderer(tok, thinking), ScriptedEnv, TurnLimits(max_turns=4))
    return tok, data, prompts, rec, driver.generate(rec, prompts, data, params)


def expected_response(tok, row, prompt, rec, i, j, thinking):
    """The reference ids of trajectory (i, j) and its engine turns: each turn's engine ids from the recorded
    call whose input is ``prompt`` + the reference so far, each tool turn cut out of one rendering of the
    whole conversation."""
    engine_turns = [rec.first[i][j]]
    first_text = tok.decode(engine_turns[0], skip_special_tokens=False).removesuffix(EOS_TEXT)
    wanted = 1 + int(hashlib.sha256(first_text.encode()).hexdigest(), 16) % 4
    tools, ids = [], list(engine_turns[0])
    while len(engine_turns) < wanted:
        tools.append(tool_messages(row, len(engine_turns)))
        n = len(engine_turns) + 1
        ids = rebuild(tok, engine_turns, split_pieces(tok, full_conversation(row, n, tools), n, thinking))
        seen = [c for inp, c in rec.requests if inp == list(prompt) + ids]
        assert len(seen) == 1, f"trajectory {i}/{j}: the engine never got prompt + the reference for turn {n}"
        engine_turns.append(list(seen[0].token_ids))
        ids += engine_turns[-1]
    return ids, engine_turns


def full_conversation(row, n_assistant, tool_texts):
    base = [{"role": "system", "content": row.system}] if row.system is not None else []
    base.append({"role": "user", "content": row.prompt})
    for k in range(n_assistant):
        base.append({"role": "assistant", "content": f"@@A{k}@@"})
        if k < len(tool_texts):
            base += tool_texts[k]
    return base


def split_pieces(tok, conv, n_assistant, thinking):
    """The text between consecutive assistant placeholders (each tool turn as the template renders it in
    the whole conversation), each ending with the next turn's opening (+ the empty think block of the
    generation prompt). The last placeholder is the last message: a template may open it with an empty
    think block that a generation prompt with thinking on does not have, so that block is cut first."""
    text = tok.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=False, enable_thinking=thinking
    )
    pieces = []
    for k in range(n_assistant - 1):
        a, b = f"@@A{k}@@", f"@@A{k + 1}@@"
        piece = text[text.index(a) + len(a) : text.index(b)].removesuffix(EMPTY_THINK)
        assert piece.endswith("<|im_start|>assistant\n")
        pieces.append(piece + ("" if thinking else EMPTY_THINK))
    return pieces


def rebuild(tok, engine_turns, pieces):
    ids = []
    for e, piece in zip(engine_turns, pieces, strict=True):
        ids += e
        if tok.decode(e[-1:], skip_special_tokens=False) == EOS_TEXT:
            piece = piece.removeprefix(EOS_TEXT)  # the engine generated the end-of-turn token itself
        ids += tok(piece, add_special_tokens=False)["input_ids"]
    return ids


def check(tok, data, prompts, rec, out, thinking):
    turns = []
    for i, group in enumerate(out):
        for j, c in enumerate(group):
            want, engine_turns = expected_response(tok, data[i], prompts[i], rec, i, j, thinking)
            assert c.token_ids == want, f"trajectory {i}/{j}: scored ids differ from engine + template ids"
            traj = Trajectory.of(c)
            assert c.finish_reason == "stop" and not traj.truncated
            spans = traj.turn_spans
            assert [c.token_ids[a:b] for a, b in spans] == engine_turns
            assert traj.response_mask == [
                int(any(a <= t < b for a, b in spans)) for t in range(len(c.token_ids))
            ]
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, traj.response_mask, strict=True) if not m)
            turns.append(traj.turns)
    return turns


@pytest.mark.parametrize("template", ["project", "official"])
@pytest.mark.parametrize(("thinking", "n_prompts"), [(False, 25), (True, 5)])
def test_scored_ids_are_the_engines_plus_the_templates_tool_turns(engine, thinking, n_prompts, template):
    """50 trajectories with thinking off (the paper's setting: every generation prompt opens with the
    empty think block), 10 with it on, under each template."""
    tok, data, prompts, rec, out = run(engine, thinking, n_prompts, template=template)
    turns = check(tok, data, prompts, rec, out, thinking)
    assert len(turns) == 2 * n_prompts
    if n_prompts == 25:
        assert set(turns) == {1, 2, 3, 4}, turns


@pytest.mark.parametrize("template", ["project", "official"])
def test_a_planted_retokenization_of_the_conversation_fails_the_check(engine, monkeypatch, template):
    real = MultiTurnRollout.completion

    def retokenized(self, s):  # the classic drift: decode the whole conversation and encode it again
        c = real(self, s)
        c.token_ids = self.renderer.encode(self.renderer.decode(c.token_ids))
        return c

    monkeypatch.setattr(MultiTurnRollout, "completion", retokenized)
    tok, data, prompts, rec, out = run(engine, thinking=False, n_prompts=6, template=template)
    with pytest.raises(AssertionError, match="scored ids differ"):
        check(tok, data, prompts, rec, out, thinking=False)


def test_the_official_template_rerenders_an_earlier_turn():
    """Why tool turns are rendered after a fixed prefix: with Qwen3's official template the conversation
    with the tool message added does not start with the conversation before it."""
    tok = tokenizer("official")
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = tok.apply_chat_template(conv, tokenize=False, enable_thinking=False)
    after = tok.apply_chat_template(
        [*conv, {"role": "tool", "content": "4"}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert EMPTY_THINK + "a" in before and EMPTY_THINK + "a" not in after and not after.startswith(before)


def _fake(render):
    renderer = TurnRenderer(qwen3_tokenizer())
    renderer.tokenizer = type("Fake", (), {})()
    renderer.tokenizer.apply_chat_template = lambda m, **kw: render(m)
    return renderer


def test_a_template_whose_tool_turn_depends_on_the_conversation_is_refused():
    # the tool message shows its position in the conversation: the two fixed prefixes give two renderings
    renderer = _fake(lambda m: "".join(f"<{x['role']} #{i}>{x['content']}" for i, x in enumerate(m)))
    with pytest.raises(TemplateDrift, match="renders them differently after different conversations"):
        renderer.tool_turn_ids([{"role": "tool", "content": "4"}], [1, 2], 1)
    # the last message rendered apart from the others: adding one re-renders the one before
    renderer = _fake(lambda m: "".join(f"<{x['role']}{'*' if x is m[-1] else ''}>{x['content']}" for x in m))
    with pytest.raises(TemplateDrift, match="re-renders the messages before them once turn 1's tool message"):
        renderer.tool_turn_ids([{"role": "tool", "content": "4"}], [1, 2], 1)


@pytest.mark.parametrize("template", ["project", "official"])
def test_the_end_of_turn_token_the_engine_generated_is_not_appended_twice(template):
    tok = tokenizer(template)
    renderer = TurnRenderer(tok)
    eos = tok.convert_tokens_to_ids(EOS_TEXT)
    new = [{"role": "tool", "content": "4"}]
    with_eos = renderer.tool_turn_ids(new, [64, eos], 1)
    without = renderer.tool_turn_ids(new, [64, 65], 1)
    assert (
        tok.decode(with_eos) == "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert without == [eos, *with_eos]
