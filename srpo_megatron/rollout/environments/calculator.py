"""A calculator tool for the arithmetic / math rows: Qwen3 ``<tool_call>`` calls, evaluated safely.

The model calls ``{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}`` inside
``<tool_call>...</tool_call>``; the environment answers each call with one ``tool`` message holding the
value (or ``error: ...``). A turn without a tool call is the final answer: the trajectory is done and
the row's verifier scores it. The expression is evaluated by walking its ``ast``: numbers, parentheses,
``+ - * / // %`` and ``**`` with a bounded exponent; anything else (names, calls, attributes) is refused,
so no model output reaches ``eval``.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from srpo_megatron.rollout.environments.base import EnvStep, parse_tool_calls

TOOL_NAME = "calculator"
MAX_EXPONENT = 64  # |b| in a ** b; larger powers are refused (a tool call must not stall the step)
MAX_EXPRESSION_CHARS = 500

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """The expression is not one the calculator evaluates; the message says why."""


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
            raise CalculatorError("division by zero")
        return Fraction(_BINARY[type(node.op)](a, b))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        a, b = _eval(node.left), _eval(node.right)
        if b.denominator != 1 or abs(b) > MAX_EXPONENT:
            raise CalculatorError(f"exponents must be integers within ±{MAX_EXPONENT}")
        if a == 0 and b < 0:
            raise CalculatorError("division by zero")
        return a**b.numerator
    raise CalculatorError(f"{type(node).__name__} is not allowed: use numbers, parentheses, + - * / // % **")


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text (an integer, or a decimal of up to 12 places)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an expression ({e.msg})") from None
    value = _eval(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


class CalculatorEnv:
    """One trajectory's calculator (no state: every call is answered on its own)."""

    def reset(self, row: Any) -> list[dict[str, str]]:
        return []

    def step(self, assistant_text: str) -> EnvStep:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            return EnvStep(done=True)
        messages, errors = [], 0
        for call in calls:
            answer = call.error and f"error: {call.error}"
            if not answer and call.name != TOOL_NAME:
                answer = f"error: unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}"
            if not answer:
                try:
                    answer = evaluate(str(call.arguments.get("expression", "")))
                except CalculatorError as e:
                    answer = f"error: {e}"
            errors += answer.startswith("error:")
            messages.append({"role": "tool", "content": answer})
        return EnvStep(messages, tool_calls=len(calls), tool_errors=errors)
