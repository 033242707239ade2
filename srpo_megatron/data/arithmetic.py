"""A synthetic, verifiable arithmetic task for CPU runs (generated from a seed, exact integer answers).

Difficulty levels (``difficulty``):

- 0: one operation on small numbers, ``What is 7 + 5? Answer with just the number.`` (a, b in 1..20,
  ``+``/``-``, never negative). SmolLM2-135M-Instruct answers about half of these right greedily
  (measured: 70% on 1..12 sums, 58% on 1..12 differences), so RL has signal from the first step.
- 1: one operation on two-digit numbers (``+``/``-``).
- 2: two operations with precedence, ``a * b + c``, ``a * b - c`` or ``(a + b) * c``.
- 3: two-step word problems (``Tom has 14 apples. He buys 9 more and gives away 5 ...``).
- 4: level 0's one operation on numbers 1..50 (``What is 37 + 18?``): between levels 0 and 1, and with
  about 380 held-out problems (level 0 has only ~60), enough for a ≥256-problem evaluation.
  Numbered 4 so the existing levels keep their numbers.
- 5: level 0's problems (one + / − on 1..20) with half of the problem space held out (~300 held-out and
  ~300 train problems) instead of 10 %: level 0's difficulty with enough held-out problems for a
  ≥256-problem evaluation. Measured with SmolLM2-135M-Instruct and reasoning at 64 new tokens (examples/
  cpu_compare/README.md): level 0 samples right 24 % of the time at temperature 0.6 and 9 % at 1.0, level 4
  5 % and 4 %: level 4 is too hard for that model to give mixed groups. The keys carry the level, so its
  split is drawn independently of level 0's.

``reasoning=True`` replaces the suffix "Answer with just the number." by "Think step by step, then give
the final number." so the model writes a short derivation before the answer (room for credit
assignment: a teacher can disagree with single steps). The reward is the same (last number == answer).

Train and held-out problems never overlap: each problem has a canonical key (its expression, not its
wording, so a rephrased train problem cannot leak into held-out) and a stable hash of the key puts it in
exactly one split (10% held-out). The split does not depend on the seed; the seed only picks which
problems and wordings are drawn. Rows use the reward kind ``arithmetic`` (last number == answer).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Literal

Split = Literal["train", "test"]
HELD_OUT_PER_MILLE = 100  # share of the problem space reserved for held-out evaluation
HELD_OUT_PER_MILLE_BY_LEVEL = {"5": 500}  # levels whose space is too small for 10 % to give 256 problems

_SUFFIX = " Answer with just the number."
REASONING_SUFFIX = " Think step by step, then give the final number."
_ONE_OP_WORDINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.")
_WORD_PROBLEMS = (
    (
        "{name} has {a} apples. {pr} buys {b} more and gives away {c}. How many apples does {pr2} have now?",
        lambda a, b, c: a + b - c,
    ),
    (
        "A box holds {a} pencils. {name} adds {b} boxes of {c} pencils each. How many pencils are there now?",
        lambda a, b, c: a + b * c,
    ),
    (
        "{name} reads {a} pages a day for {b} days, then {c} more pages. How many pages did {pr2} read?",
        lambda a, b, c: a * b + c,
    ),
)
_NAMES = (("Tom", "He", "he"), ("Anna", "She", "she"), ("Ravi", "He", "he"), ("Mei", "She", "she"))


def problem_split(key: str) -> Split:
    """The split a problem (by canonical key ``"{level}/{expression}"``) belongs to; stable across seeds,
    runs and machines."""
    share = HELD_OUT_PER_MILLE_BY_LEVEL.get(key.split("/", 1)[0], HELD_OUT_PER_MILLE)
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h % 1000 < share else "train"


def _one_op(rng: random.Random, lo: int, hi: int, wordings=_ONE_OP_WORDINGS) -> tuple[str, str, int]:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = rng.choice("+-")
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b
    text = rng.choice(wordings).format(a=a, op=op, b=b) + _SUFFIX
    return f"{a}{op}{b}", text, value


def _two_ops(rng: random.Random) -> tuple[str, str, int]:
    a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 20)
    form = rng.randrange(3)
    if form == 1:
        c = min(c, a * b)  # answers stay non-negative
    expr = (f"{a} * {b} + {c}", f"{a} * {b} - {c}", f"({a} + {b}) * {c % 9 + 2}")[form]
    value = eval(expr, {"__builtins__": {}})  # our own digits and operators only
    text = rng.choice(_ONE_OP_WORDINGS[:2]).format(a=expr, op="", b="").replace("  ", " ")
    text = text.replace(" ?", "?").replace(" .", ".") + _SUFFIX
    return expr.replace(" ", ""), text, int(value)


def _word(rng: random.Random) -> tuple[str, str, int]:
    t = rng.randrange(len(_WORD_PROBLEMS))
    template, fn = _WORD_PROBLEMS[t]
    a, b, c = rng.randint(5, 30), rng.randint(2, 12), rng.randint(1, 9)
    if t == 0:
        c = rng.randint(1, a + b)  # never negative
    name, pr, pr2 = rng.choice(_NAMES)
    text = template.format(name=name, pr=pr, pr2=pr2, a=a, b=b, c=c) + _SUFFIX
    return f"w{t}:{a},{b},{c}", text, fn(a, b, c)


_LEVELS: dict[int, Callable[[random.Random], tuple[str, str, int]]] = {
    # "What is" only: SmolLM2 answers it tersely, "Compute"/"Calculate" make it explain at length.
    0: lambda rng: _one_op(rng, 1, 20, _ONE_OP_WORDINGS[:1]),
    1: lambda rng: _one_op(rng, 10, 99),
    2: _two_ops,
    3: _word,
    4: lambda rng: _one_op(rng, 1, 50, _ONE_OP_WORDINGS[:1]),
    5: lambda rng: _one_op(rng, 1, 20, _ONE_OP_WORDINGS[:1]),
}


def generate_arithmetic_rows(
    split: Split, n: int, difficulty: int = 0, seed: int = 0, reasoning: bool = False
) -> list[dict]:
    """``n`` rows (prompt, system=None, answer, kind="arithmetic") of ``split`` at ``difficulty``.

    ``reasoning`` asks for step-by-step work before the final number instead of the number alone.

    Prompts are distinct while the split's problem space allows it (level 0 has a few hundred wordings
    per split); beyond that, problems repeat — they never cross into the other split.
    """
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty={difficulty} is not valid; choose one of {sorted(_LEVELS)}")
    # Seed separately per split so that train and test draws are independent streams.
    rng = random.Random(f"arithmetic/{difficulty}/{split}/{seed}")
    rows: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        key, text, value = _LEVELS[difficulty](rng)
        if problem_split(f"{difficulty}/{key}") != split:
            continue
        if reasoning:
            text = text.removesuffix(_SUFFIX) + REASONING_SUFFIX
        if text in seen and attempts < 200 * (n + 10):
            continue
        seen.add(text)
        rows.append(
            {
                "prompt": text,
                "system": None,
                "answer": str(value),
                "kind": "arithmetic",
                "dataset": f"arithmetic/level{difficulty}",
                "key": f"{difficulty}/{key}",
            }
        )
    return rows
