"""A safe arithmetic evaluator: the ``calculator`` tool of the built-in environments.

Parses with :mod:`ast` and evaluates only numbers, ``+ - * / // % **``,
unary signs and parentheses; never ``eval``.  Bounds keep a hostile or
confused agent from burning the runtime, each checked *before* the work it
bounds: at most :data:`MAX_CHARS` characters and :data:`MAX_NODES` syntax
nodes; every operand and result below :data:`MAX_MAGNITUDE` (at most 30
digits); exponents up to :data:`MAX_EXPONENT`, and a power refused unless its
result's digits (estimated from the operands) stay within
:data:`MAX_DIGITS`.  ``((9**99)**99)**99`` is refused at once; the agent
program's own copy of the evaluator once crashed on it and burned 20 s of
CPU one level deeper.

This module is the one evaluator of both agents: the in-process harness
imports it, and the agent *program* (``envs/agent_program.py``, which must
not import lowwater) loads this file by path.  So it imports the standard
library only.

GSM8K's calculator annotations (``<<48/2=24>>``) use this grammar; a
thousands separator (``1,050``) is accepted, as in the recorded solutions.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable
from typing import Any

MAX_CHARS = 256
#: Syntax nodes of the parsed expression (``ast.walk``); GSM8K's longest annotation has 35.
MAX_NODES = 100
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e30
#: Decimal digits of a power's result (``MAX_MAGNITUDE`` has 31).
MAX_DIGITS = 31

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BAD_ARGUMENTS = "error: arguments must be a JSON object with an 'expression' string"


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def evaluate(expression: str) -> float | int:
    """Value of an arithmetic ``expression``.

    Raises:
        CalculatorError: anything but numbers, ``+ - * / // % **`` and
            parentheses; more than :data:`MAX_CHARS` characters or
            :data:`MAX_NODES` nodes; division by zero; an exponent above
            :data:`MAX_EXPONENT` or a power past :data:`MAX_DIGITS` digits; an
            operand or result of :data:`MAX_MAGNITUDE` or more.
    """
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    text = _THOUSANDS.sub("", expression.strip())
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a NUL in the text
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise CalculatorError(f"expression has {nodes} parts, more than {MAX_NODES}")
    return _check(_eval(tree.body))


def format_result(value: float | int) -> str:
    """The calculator's answer as an agent sees it: integers without ``.0``, others to 10 digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.10g}"


def tool_answer(arguments: str) -> str:
    """The tool's answer to a call's JSON ``arguments`` (``{"expression": ...}``).

    Errors become text the model sees (``"error: ..."``), never exceptions.
    """
    try:
        expression = json.loads(arguments)["expression"]
        return format_result(evaluate(str(expression)))
    except CalculatorError as exc:
        return f"error: {exc}"
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):  # ValueError: not JSON
        return _BAD_ARGUMENTS


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _check(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result out of range") from None
    raise CalculatorError(f"unsupported element {type(node).__name__} in arithmetic")


def _check_power(base: float | int, exponent: float | int) -> None:
    """Refuse a power before computing it: its digits are ``exponent * log10(|base|)``."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} above {MAX_EXPONENT}")
    if exponent > 0 and abs(base) > 1 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise CalculatorError(f"result out of range (more than {MAX_DIGITS} digits)")


def _check(value: float | int) -> float | int:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) >= MAX_MAGNITUDE:
        raise CalculatorError("result out of range")
    return value
