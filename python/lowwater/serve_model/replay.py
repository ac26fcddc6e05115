"""Serving an annotated solution as multi-turn tool use, and the replay model.

A GSM8K-style solution is prose with calculator annotations
``<<expr=result>>`` and a last line ``A: N``.  :func:`solution_turn` cuts it
into turns *statelessly*: the caller says how many tool results the
conversation already holds (``k``) and gets turn ``k``:

* turn ``k`` (while annotations remain) is the text after annotation
  ``k-1``'s ``>>`` up to annotation ``k``'s ``<<``, plus a ``calculator``
  tool call with ``{"expression": expr}``;
* the last turn is the rest of the text, including ``A: N``, and stops.

The tool result's value never alters the text: a replay is faithful to the
recording, glitches included.  Joining every turn's ``text`` and
``annotation`` gives back the recorded solution exactly (the tests check
this for every row of the recorded columns).

Annotation grammar, as it occurs in the recordings: ``<<`` up to the next
``>>``; the expression is what precedes the first ``=`` (the whole content
when there is none, as in one recorded ``<<83.33333333333333>>``).  A ``<<``
without a closing ``>>`` (truncated recordings) is plain text.

:class:`ReplayModel` serves one column of a JSONL file of recorded solutions
(such as GSM8K's ``example_model_solutions.jsonl``), keyed by question text.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import orjson

TOOL_NAME = "calculator"

_ANNOTATION = re.compile(r"<<(.*?)>>", re.DOTALL)
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class ModelError(Exception):
    """A request the model cannot answer; the server returns 400 with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownQuestion(ModelError):
    """No recorded solution for the request's question (a 404-style 400)."""


class ReplayDataError(ValueError):
    """A replay file that cannot be loaded: missing, malformed line, unknown column.

    The message is one line naming the file (and line number where there is one).
    """


@attrs.frozen
class ToolCall:
    """A ``calculator`` call.

    Attributes:
        id: deterministic per (question, turn); protocols add their prefix
            (``call_``, ``toolu_``, ``fc_``).
        name: always :data:`TOOL_NAME`.
        expression: the arithmetic expression; the wire arguments are
            ``{"expression": expression}``.
    """

    id: str
    name: str
    expression: str

    @property
    def arguments(self) -> str:
        """The arguments as the JSON string OpenAI protocols carry."""
        return orjson.dumps({"expression": self.expression}).decode()


@attrs.frozen
class Reply:
    """One model turn, protocol-agnostic.

    Attributes:
        text: the assistant text of this turn (may be empty before a tool call).
        tool_call: the tool call ending this turn, or ``None`` on the last turn.
        annotation: the recorded ``<<...>>`` markup this turn's tool call
            stands for (never sent; it lets a walk rebuild the recording).
    """

    text: str
    tool_call: ToolCall | None = None
    annotation: str | None = None


def normalize(text: str) -> str:
    """``text`` with every whitespace run collapsed to one space, ends stripped."""
    return " ".join(text.split())


def question_candidates(text: str) -> Iterator[str]:
    """Lookup keys for a user message, in order: the whole text, then the part after its last blank line.

    Agents often put an instruction before the question, separated by a
    blank line; both keys are whitespace-normalized.
    """
    whole = normalize(text)
    yield whole
    parts = [p for p in _BLANK_LINE.split(text) if p.strip()]
    if len(parts) > 1:
        last = normalize(parts[-1])
        if last != whole:
            yield last


def annotation_matches(solution: str) -> list[re.Match[str]]:
    """The closed ``<<...>>`` annotations of ``solution``, in order."""
    return list(_ANNOTATION.finditer(solution))


def solution_turn(solution: str, tool_results: int, call_id_prefix: str, *, tools: bool = True) -> Reply:
    """Turn ``tool_results`` of ``solution`` served as tool use (see the module docstring).

    Args:
        solution: the recorded (or reference) solution text.
        tool_results: tool results already in the conversation, 0 for the first turn.
        call_id_prefix: stable per question; call ``k``'s id is ``f"{prefix}{k}"``.
        tools: ``False`` when the request offers no ``calculator`` tool: the
            whole solution, annotations included, is then one turn.

    Raises:
        ModelError: ``tool_results`` is more than the solution has annotations.
    """
    if not tools:
        if tool_results:
            raise ModelError("the request has tool results but offers no calculator tool")
        return Reply(solution)
    # Only the first k+1 annotations matter; finditer stops early on long texts.
    start = steps = 0
    for match in _ANNOTATION.finditer(solution):
        if steps == tool_results:
            expression = match.group(1).split("=", 1)[0]
            call = ToolCall(f"{call_id_prefix}{steps}", TOOL_NAME, expression)
            return Reply(solution[start : match.start()], call, match.group(0))
        start = match.end()
        steps += 1
    if tool_results > steps:
        raise ModelError(
            f"the conversation has {tool_results} tool results but the solution has only {steps} calculator steps"
        )
    return Reply(solution[start:])


def call_id_prefix(question: str) -> str:
    """A stable 12-hex-digit id stem for the tool calls of ``question``."""
    return hashlib.blake2b(normalize(question).encode(), digest_size=6).hexdigest() + "_"


@attrs.define
class ReplayModel:
    """Serves recorded solutions, one column of a JSONL file, keyed by question text.

    Build it with :meth:`from_jsonl`.  The index holds one string per
    question (whitespace-normalized question -> solution of the chosen
    column) and nothing else; a repeated question keeps its first solution.

    Attributes:
        solutions: the index.
        name: the model id reported by ``/v1/models`` (``replay:COLUMN``).
        latency_s: seconds slept (``trio.sleep``) before each response.
        payload_bytes: size of the extra ``x_lowwater_payload`` field in every
            response (0: none), to make responses image-sized in memory tests.
    """

    solutions: dict[str, str]
    name: str = "replay"
    latency_s: float = 0.0
    payload_bytes: int = 0

    @classmethod
    def from_jsonl(
        cls, path: str | Path, column: str, *, latency_s: float = 0.0, payload_bytes: int = 0
    ) -> ReplayModel:
        """Load ``column`` of every row of the JSONL file at ``path``.

        Each non-blank line is an object with a ``question`` string and
        ``column``, either a string (``ground_truth``, GSM8K's ``answer``)
        or an object with a ``solution`` string (the recorded model columns).

        Raises:
            ReplayDataError: the file cannot be read, a line is not a JSON
                object (with its 1-based line number), or a row lacks
                ``question`` or ``column`` (the first row's columns are listed).
        """
        path = Path(path)
        solutions: dict[str, str] = {}
        try:
            handle = path.open("rb")
        except OSError as exc:
            raise ReplayDataError(f"cannot read {path}: {exc.strerror or exc}") from None
        with handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                question, solution = _row(path, number, line, column)
                solutions.setdefault(normalize(question), solution)
        if not solutions:
            raise ReplayDataError(f"{path}: no rows")
        return cls(solutions, f"replay:{column}", latency_s, payload_bytes)

    def solution(self, question: str) -> str:
        """The recorded solution for a user message containing ``question``.

        Tried in order: the whole message, then its text after the last
        blank line (both whitespace-normalized).

        Raises:
            UnknownQuestion: neither key is in the index.
        """
        for key in question_candidates(question):
            found = self.solutions.get(key)
            if found is not None:
                return found
        raise UnknownQuestion(f"unknown question: {normalize(question)[:120]!r}")

    def reply(self, question: str, tool_results: int, *, tools: bool = True) -> Reply:
        """Turn ``tool_results`` of the recorded solution of ``question`` (see :func:`solution_turn`).

        Raises:
            UnknownQuestion: the question is not in the index.
            ModelError: more tool results than the solution has calculator steps.
        """
        return solution_turn(self.solution(question), tool_results, call_id_prefix(question), tools=tools)


def _row(path: Path, number: int, line: bytes, column: str) -> tuple[str, str]:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ReplayDataError(f"{path}:{number}: malformed JSON line: {exc}") from None
    if not isinstance(row, dict):
        raise ReplayDataError(f"{path}:{number}: a line must be a JSON object")
    question = row.get("question")
    if not isinstance(question, str):
        raise ReplayDataError(f'{path}:{number}: no "question" string')
    if column not in row:
        known = ", ".join(k for k in row if k != "question")
        raise ReplayDataError(f"{path}:{number}: unknown column {column!r} (columns: {known})")
    value = row[column]
    if isinstance(value, dict):
        value = value.get("solution")
    if not isinstance(value, str):
        raise ReplayDataError(
            f'{path}:{number}: column {column!r} is neither a string nor an object with a "solution" string'
        )
    return question, value
