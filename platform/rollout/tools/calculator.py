"""The ``calculator`` tool: arithmetic on an AST walk, never ``eval``.

Numbers, ``+ - * / // % **``, parentheses, and a few functions and constants from
:mod:`math`. Every step is bounded (exponents, factorials, the size of integers), so no
expression can take the tool worker's CPU or memory.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable, Union

Number = Union[int, float]

MAX_CHARS = 1000
MAX_EXPONENT = 1000
MAX_FACTORIAL = 1000
MAX_INT_BITS = 4096

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _factorial(x: Number) -> int:
    if x != int(x) or not 0 <= x <= MAX_FACTORIAL:
        raise ValueError(f"factorial takes a whole number from 0 to {MAX_FACTORIAL}")
    return math.factorial(int(x))


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "factorial": _factorial,
    "gcd": math.gcd,
    "min": min,
    "max": max,
}


class CalculatorError(ValueError):
    pass


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"a number larger than 2**{MAX_INT_BITS}")
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _eval(node.left), _eval(node.right)
        if abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"an exponent beyond ±{MAX_EXPONENT}")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and base.bit_length() * exponent > MAX_INT_BITS:
            raise CalculatorError(f"a number larger than 2**{MAX_INT_BITS}")
        return _checked(base**exponent)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
        return _checked(_FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
    raise CalculatorError(f"not arithmetic: {ast.unparse(node)[:80]!r}")


def evaluate(expression: str) -> Number:
    """The value of ``expression``; raises CalculatorError (a ValueError) saying why not."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse the expression: {e.msg}") from None
    try:
        return _eval(tree)
    except CalculatorError:
        raise
    except (ArithmeticError, ValueError, TypeError) as e:
        raise CalculatorError(f"{type(e).__name__}: {e}") from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. `(3 + 4) * sqrt(16) / 2`."""
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)
