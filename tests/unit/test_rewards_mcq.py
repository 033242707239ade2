"""The MCQ reward on real SciKnowEval rows: the last <answer>…</answer>, stripped, equals the gold letter.

Each case is a hand-written response for a real row of ../shared/data; ``{gold}`` is that row's letter
and ``{other}`` a different letter, so the expectation is worked out by hand from the paper's rule.
"""

from __future__ import annotations

import functools

import pytest

from srpo_megatron.data import default_data_dir, load_rows
from srpo_megatron.rewards import get_reward_fn


@functools.cache
def real_row(relpath: str, line: int):
    rows, _ = load_rows(default_data_dir() / relpath)
    row = next(r for r in rows if r.source.endswith(f":{line}"))
    assert row.kind == "mcq" and row.answer in "ABCD"
    return row


DOMAINS = ("chemistry", "physics", "biology", "material")
CHEM, PHYS, BIO, MAT = (f"sciknoweval/{d}/test.jsonl" for d in DOMAINS)

CASES = [
    # right answers in the requested format and small variations
    (CHEM, 1, "<reasoning>\nIt follows.\n</reasoning>\n<answer>\n{gold}\n</answer>", 1.0),
    (CHEM, 2, "<answer>{gold}</answer>", 1.0),
    (PHYS, 1, "<answer>   {gold}   </answer>", 1.0),
    (PHYS, 2, "<answer>\t{gold}\n</answer>\n", 1.0),
    (BIO, 1, "Some reasoning first.\n<answer>\n{gold}\n</answer> trailing text", 1.0),
    (MAT, 3, "<reasoning>x</reasoning><answer>{gold}</answer>", 1.0),
    # wrong letter
    (CHEM, 3, "<answer>\n{other}\n</answer>", 0.0),
    (PHYS, 3, "<reasoning>\n...\n</reasoning>\n<answer>{other}</answer>", 0.0),
    (BIO, 2, "<answer> {other} </answer>", 0.0),
    # several tags: only the last one counts
    (BIO, 3, "<answer>{other}</answer> no wait <answer>{gold}</answer>", 1.0),
    (MAT, 1, "<answer>{gold}</answer> on second thought <answer>{other}</answer>", 0.0),
    (MAT, 2, "<answer>{gold}</answer>\n<answer>\n{gold}\n</answer>", 1.0),
    # malformed: no tag, unclosed tag, wrong tag name, empty tag
    (CHEM, 1, "The answer is {gold}.", 0.0),
    (CHEM, 2, "<answer>{gold}", 0.0),
    (PHYS, 1, "<Answer>{gold}</Answer>", 0.0),
    (PHYS, 2, "<answer></answer>", 0.0),
    (BIO, 1, "", 0.0),
    # an unclosed tag after a complete one: the complete one is the last block
    (BIO, 2, "<answer>{gold}</answer> and then <answer>{other}", 1.0),
    # extra text inside the tag is not an exact match
    (MAT, 3, "<answer>{gold}.</answer>", 0.0),
    (MAT, 1, "<answer>Option {gold}</answer>", 0.0),
    (CHEM, 3, "<answer>({gold})</answer>", 0.0),
    (PHYS, 3, "<answer>{gold}, {other}</answer>", 0.0),
    # case matters (the gold letters are upper-case)
    (BIO, 3, "<answer>{gold_lower}</answer>", 0.0),
    # the letter elsewhere does not help when the tag is wrong
    (MAT, 2, "{gold}{gold}{gold} <answer>{other}</answer>", 0.0),
    # the reasoning may contain tags-as-text; still only the last complete pair counts
    (CHEM, 2, "I will write <answer>X</answer> at the end.\n<answer>\n{gold}\n</answer>", 1.0),
    (PHYS, 1, "<answer>\n\n{gold}\n\n</answer>", 1.0),
]


@pytest.mark.parametrize(("relpath", "line", "template", "expected"), CASES)
def test_mcq_reward_on_real_rows(relpath, line, template, expected):
    row = real_row(relpath, line)
    other = next(c for c in "ABCD" if c != row.answer)
    response = template.format(gold=row.answer, other=other, gold_lower=row.answer.lower())
    assert get_reward_fn("mcq")(response, row.answer) == expected


def test_enough_mcq_cases():
    assert len(CASES) >= 25
