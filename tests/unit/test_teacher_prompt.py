"""The teacher's prompt (method §1.4) is built as SDPO's code builds it (verl ``ray_trainer``:
``_remove_thinking_trace``, ``_build_teacher_message``, one ``apply_chat_template`` call), on the packaged
SmolLM2 and Qwen3 tokenizers: each think block and the whitespace after it removed, nothing stripped,
and the chat template called with ``teacher.enable_thinking``.

The reference here is written independently (a string scan, not SDPO's regex, and SDPO's own
templates with their YAML block-scalar newlines); the old rule (``sub(...).strip()``) is planted to show
the cases tell the two apart, on the strings and on the token ids.
"""

from __future__ import annotations

import re

import pytest

from srpo_megatron.config import TeacherConfig
from srpo_megatron.data.assets import qwen3_tokenizer, smollm2_tokenizer
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.trainer.collect.sample_routing import clean_solution, teacher_prompt_ids

OPEN, CLOSE = "<think>", "</think>"


def sdpo_remove_thinking(text: str) -> str:
    """SDPO's rule by hand: drop each ``<think>…</think>`` (first closing tag) and the whitespace after it."""
    out, pos = [], 0
    while (i := text.find(OPEN, pos)) >= 0 and (j := text.find(CLOSE, i + len(OPEN))) >= 0:
        out.append(text[pos:i])
        pos = j + len(CLOSE)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return "".join(out) + text[pos:]


def old_rule(text: str) -> str:
    """What the project did before (planted): the blocks removed, then ``.strip()``."""
    return re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL).strip()


# (decoded sibling response, what the teacher must be shown) — leading/trailing whitespace, think blocks
CASES = [
    (" The answer is <answer>B</answer>", " The answer is <answer>B</answer>"),
    ("<think>\nscratch\n</think>\n\nThe answer is B.  \n", "The answer is B.  \n"),
    ("  <think>a</think>  B", "  B"),
    ("A<think>a\n</think> \n B<think>b</think>C", "ABC"),
    ("<think>unclosed, kept B", "<think>unclosed, kept B"),
    ("\n\n42\n", "\n\n42\n"),
    ("x = 3 <think>one</think><think>two</think>\t\n done", "x = 3 done"),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_clean_solution_is_sdpos_rule(text, expected):
    assert sdpo_remove_thinking(text) == expected  # the reference reads the cases as written
    assert clean_solution(text) == expected


def test_the_cases_tell_the_old_strip_rule_apart():
    differ = [t for t, e in CASES if old_rule(t) != e]
    assert len(differ) >= 5, "the planted .strip() rule must fail most cases"


@pytest.fixture(scope="module", params=["qwen3", "smollm2"])
def tokenizer(request):
    return qwen3_tokenizer() if request.param == "qwen3" else smollm2_tokenizer()


# SDPO's templates (verl actor.yaml, ``|-`` block scalars: no final newline; the solution section starts
# with one), the feedback section empty (no environment feedback for solved groups).
SDPO_REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."
SDPO_SOLUTION = "\nCorrect solution:\n\n{successful_previous_attempt}"


def sdpo_teacher_ids(tok, row: Row, response: str, enable_thinking: bool, max_len: int) -> list[int]:
    """SDPO's teacher prompt: system messages kept, the user turn reprompted, one templated call."""
    solution = SDPO_SOLUTION.format(successful_previous_attempt=sdpo_remove_thinking(response))
    user = SDPO_REPROMPT.format(prompt=row.prompt, solution=solution, feedback="")
    messages = ([{"role": "system", "content": row.system}] if row.system is not None else []) + [
        {"role": "user", "content": user}
    ]
    enc = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return list(enc["input_ids"])[:max_len]


ROWS = [
    Row("Which is a noble gas?\n(A) N2 (B) Ar", "Answer with <answer>X</answer>.", "B", "mcq", "t", "t:1"),
    Row("Call the weather API for Paris.", None, "-", "tooluse", "t", "t:2"),
]


def _prompt(row: Row) -> Prompt:
    return Prompt(ids=(), row=row)


@pytest.mark.parametrize("row", ROWS, ids=["system", "no_system"])
@pytest.mark.parametrize("response", [t for t, _ in CASES], ids=[f"case{i}" for i in range(len(CASES))])
def test_teacher_prompt_ids_equal_sdpos(tokenizer, row, response):
    cfg = TeacherConfig()
    got = teacher_prompt_ids(tokenizer, _prompt(row), response, cfg)
    assert got == sdpo_teacher_ids(tokenizer, row, response, False, cfg.max_prompt_tokens)


def test_a_decoded_sibling_with_leading_whitespace_changes_the_ids(tokenizer):
    """The path ``reward_groups`` takes (decode with special tokens skipped), on real token ids: the
    leading space SDPO keeps is a different token than the old rule's stripped text."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer(" The answer is <answer>B</answer>\n", add_special_tokens=False)["input_ids"], eos]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == " The answer is <answer>B</answer>\n"
    cfg, prompt = TeacherConfig(), _prompt(ROWS[0])
    got = teacher_prompt_ids(tokenizer, prompt, text, cfg)
    assert got == sdpo_teacher_ids(tokenizer, ROWS[0], text, False, cfg.max_prompt_tokens)
    user = cfg.solution_template.format(user_prompt=ROWS[0].prompt, sibling_response=old_rule(text))
    old = list(
        tokenizer.apply_chat_template(
            [{"role": "system", "content": ROWS[0].system}, {"role": "user", "content": user}],
            tokenize=True,
            return_dict=True,
            add_generation_prompt=True,
            enable_thinking=False,
        )["input_ids"]
    )
    assert got != old, "the planted .strip() rule must give other ids"


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_teacher_enable_thinking_reaches_the_chat_template(enable_thinking):
    """Qwen3's template: thinking off opens the reply with an empty think block, thinking on does not."""
    tok = qwen3_tokenizer()
    cfg = TeacherConfig(enable_thinking=enable_thinking)
    ids = teacher_prompt_ids(tok, _prompt(ROWS[0]), "B", cfg)
    assert ids == sdpo_teacher_ids(tok, ROWS[0], "B", enable_thinking, cfg.max_prompt_tokens)
    text = tok.decode(ids)
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    if enable_thinking:
        assert text.endswith("<|im_start|>assistant\n") and not text.endswith(empty_think)
    else:
        assert text.endswith(empty_think)


def test_teacher_prompt_is_right_truncated():
    tok = qwen3_tokenizer()
    full = teacher_prompt_ids(tok, _prompt(ROWS[0]), "B", TeacherConfig())
    cut = teacher_prompt_ids(tok, _prompt(ROWS[0]), "B", TeacherConfig(max_prompt_tokens=7))
    assert cut == full[:7]
