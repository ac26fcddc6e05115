"""A safe arithmetic evaluator: the ``calculator`` tool of the built-in environments.

Parses with :mod:`ast` and evaluates only numbers, ``+ - * / // % **``,
unary signs and parentheses; never ``eval``.  Bounds keep a hostile or
confused agent from burning the runtime: at most :data:`MAX_CHARS`
characters, exponents up to :data:`MAX_EXPONENT`, and results whose
magnitude stays below :data:`MAX_MAGNITUDE`.

GSM8K's calculator annotations (``<<48/2=24>>``) use this grammar; a
thousands separator (``1,050``) is accepted, as in the recorded solutions.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_CHARS = 256
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e30

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def evaluate(expression: str) -> float | int:
    """Value of an arithmetic ``expression``.

    Raises:
        CalculatorError: anything but numbers, ``+ - * / // % **`` and
            parentheses; division by zero; an exponent above
            :data:`MAX_EXPONENT`; a magnitude of :data:`MAX_MAGNITUDE` or more.
    """
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    text = _THOUSANDS.sub("", expression.strip())
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _check(_eval(tree.body))


def format_result(value: float | int) -> str:
    """The calculator's answer as an agent sees it: integers without ``.0``, others to 10 digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.10g}"


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} above {MAX_EXPONENT}")
        try:
            return _check(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result out of range") from None
    raise CalculatorError(f"unsupported element {type(node).__name__} in arithmetic")


def _check(value: float | int) -> float | int:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) >= MAX_MAGNITUDE:
        raise CalculatorError("result out of range")
    return value
