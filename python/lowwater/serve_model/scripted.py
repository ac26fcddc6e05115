"""The scripted model: deterministic answers with no data file.

It answers the embedded default environment (:mod:`lowwater.envs.arithmetic`)
correctly, over several turns of ``calculator`` tool calls, and anything
else with a fixed filler text.

How it recognises an arithmetic problem, from the request text alone (the
server is stateless and the question does not carry its seed): each of the
generator's four story templates has a pattern here; a match gives the
name and numbers, which are fed back to that template's own generator
function (``lowwater.envs.arithmetic.TEMPLATES``) through a stand-in
for its random source.  The problem counts as recognised only if the
regenerated question equals the matched text and every number lies in the
generator's ranges, so a template change in ``arithmetic.py`` makes the
scripted model fall back rather than answer wrongly (the tests check
recognition over many seeds).  The rebuilt reference solution, with its
``<<expr=value>>`` annotations, is then served turn by turn exactly as a
replay is (:func:`lowwater.serve_model.replay.solution_turn`).

A registry of extra ``question -> annotated solution`` pairs can be passed
in (``solutions=``) for other environments; it is consulted first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from lowwater.envs import arithmetic
from lowwater.envs.calculator import evaluate, format_result
from lowwater.serve_model import tokens
from lowwater.serve_model.replay import Reply, call_id_prefix, normalize, question_candidates, solution_turn

_N = r"(\d+)"
# (template generator, pattern over whitespace-normalized text, draws in the
# order the generator asks its random source for them).  The name is group 1.
_TEMPLATES: list[tuple[Callable[..., Any], re.Pattern[str], Callable[[list[int]], list[int]]]] = [
    (
        arithmetic.TEMPLATES["bakery"],
        re.compile(
            rf"([A-Z][a-z]+) bakes {_N} trays of rolls with {_N} rolls on each tray\. \1 sells {_N} rolls "
            rf"and packs the rest into bags of {_N}\. How many full bags does \1 pack\?"
        ),
        lambda n: [n[0], n[1], n[2], n[3]],
    ),
    (
        arithmetic.TEMPLATES["savings"],
        re.compile(
            rf"([A-Z][a-z]+) saves \${_N} every week for {_N} weeks, then buys {_N} books that cost \${_N} "
            rf"each\. How many dollars does \1 have left\?"
        ),
        lambda n: [n[0], n[1], n[3], n[2]],  # weekly, weeks, price, count
    ),
    (
        arithmetic.TEMPLATES["garden"],
        re.compile(
            rf"([A-Z][a-z]+) plants {_N} rows of tomatoes with {_N} plants in each row\. {_N}% of the plants "
            rf"die\. Each surviving plant gives {_N} tomatoes\. How many tomatoes does \1 harvest\?"
        ),
        # rows and plants are drawn as multiples of 5 and 4.
        lambda n: [n[0] // 5 if n[0] % 5 == 0 else -1, n[1] // 4 if n[1] % 4 == 0 else -1, n[2], n[3]],
    ),
    (
        arithmetic.TEMPLATES["trip"],
        re.compile(
            rf"([A-Z][a-z]+) drives at {_N} km per hour for {_N} hours, then cycles back the same distance "
            rf"at {_N} km per hour\. How many hours does the whole trip take\?"
        ),
        lambda n: [n[0], n[1], n[2]],
    ),
]


class _Replayed(Exception):
    """A parsed value the generator could not have drawn."""


class _Draws:
    """Stands in for ``random.Random``: hands the generator the parsed values, checking its ranges."""

    def __init__(self, values: Iterable[int]) -> None:
        self._values = iter(values)

    def _next(self) -> int:
        try:
            return next(self._values)
        except StopIteration:
            raise _Replayed from None

    def randint(self, low: int, high: int) -> int:
        value = self._next()
        if not low <= value <= high:
            raise _Replayed
        return value

    def choice(self, options: list[int]) -> int:
        value = self._next()
        if value not in options:
            raise _Replayed
        return value


def arithmetic_solution(text: str) -> str | None:
    """The reference solution of the arithmetic problem inside ``text``, or ``None``.

    ``text`` may hold other words around the problem; whitespace is
    normalized first.  The solution is the one
    :func:`lowwater.envs.arithmetic.problem` attaches to the problem
    (``<<expr=value>>`` annotations, last line ``A: answer``).
    """
    flat = normalize(text)
    for generate, pattern, order in _TEMPLATES:
        match = pattern.search(flat)
        if match is None or match.group(1) not in arithmetic.NAMES:
            continue
        try:
            question, plan = generate(_Draws(order([int(g) for g in match.groups()[1:]])), match.group(1))
        except _Replayed:
            continue
        if question != match.group(0):
            continue
        # Same construction as arithmetic.problem(), which needs the seed.
        lines, value = [], ""
        for expr, sentence in plan:
            value = format_result(evaluate(expr))
            lines.append(sentence.format(f"{expr}=<<{expr}={value}>>{value}"))
        lines.append(f"A: {value}")
        return "\n".join(lines)
    return None


@attrs.define
class ScriptedModel:
    """Deterministic answers: arithmetic problems solved with tool calls, filler otherwise.

    Attributes:
        latency_s: seconds slept (``trio.sleep``) before each response.
        completion_tokens: length of the filler answer to unrecognised prompts, in tokens (>= 1).
        payload_bytes: size of the extra ``x_lowwater_payload`` field in every
            response (0: none), to make responses image-sized in memory tests.
        solutions: extra ``question -> annotated solution`` pairs, looked up
            before the arithmetic templates (keys are whitespace-normalized
            on construction).
        name: the model id reported by ``/v1/models``.
    """

    latency_s: float = 0.0
    completion_tokens: int = 16
    payload_bytes: int = 0
    solutions: Mapping[str, str] = attrs.field(
        factory=dict, converter=lambda m: {normalize(k): v for k, v in m.items()}
    )
    name: str = "scripted"

    def __attrs_post_init__(self) -> None:
        if self.completion_tokens < 1:
            raise ValueError(f"completion_tokens must be >= 1, got {self.completion_tokens}")
        if self.latency_s < 0 or self.payload_bytes < 0:
            raise ValueError("latency_s and payload_bytes must be >= 0")

    def solve(self, question: str) -> str | None:
        """The annotated solution for a user message, or ``None`` if there is no script for it."""
        for key in question_candidates(question):
            if key in self.solutions:
                return self.solutions[key]
        return arithmetic_solution(question)

    def reply(self, question: str, tool_results: int, *, tools: bool = True) -> Reply:
        """Turn ``tool_results`` of the scripted answer to ``question``.

        A recognised problem is served like a replay (see
        :func:`~lowwater.serve_model.replay.solution_turn`); anything else
        gets the filler text of :attr:`completion_tokens` tokens and stops,
        whatever the conversation holds.

        Raises:
            ModelError: a recognised problem with more tool results than it has steps.
        """
        solution = self.solve(question)
        if solution is None:
            return Reply(tokens.filler(self.completion_tokens))
        return solution_turn(solution, tool_results, call_id_prefix(question), tools=tools)
