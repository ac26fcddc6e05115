"""Harness helpers for environment authors (public and stable, see docs/plugins.md).

What the built-in arithmetic environment and the GSM8K plugin share, for any
environment to reuse through public names only:

* :func:`chat_tool_loop` — an in-process chat-completions loop over the
  engine's client (``ctx.http``), with the ``calculator`` tool or tools made
  from plain Python functions (:func:`function_tool`);
* :func:`run_program_agent` — the built-in agent *program* (the same loop
  with the official ``openai`` SDK) run in the rollout's runtime, warm on a
  persistent runtime;
* :func:`run_calculator_agent` — whichever of the two ``ctx.harness`` asks for;
* :func:`final_answer`, :func:`to_number`, :func:`same_number` — answer
  extraction and exact numeric comparison for rubrics.

Names here keep their signatures and meaning across minor releases; a
change is announced with a :class:`DeprecationWarning` one release ahead.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from lowwater.envs.calculator import tool_answer
from lowwater.rollout import RolloutFailed

if TYPE_CHECKING:  # pragma: no cover
    import httpx

    from lowwater.environment import HarnessContext

__all__ = [
    "AGENT_PROGRAM",
    "CALCULATOR_TOOL",
    "SYSTEM_PROMPT",
    "chat_tool_loop",
    "final_answer",
    "function_tool",
    "run_calculator",
    "run_calculator_agent",
    "run_program_agent",
    "same_number",
    "to_number",
]

SYSTEM_PROMPT = (
    "Solve the math word problem step by step. Use the calculator tool for every "
    "arithmetic step. Finish with a last line of the form 'A: <number>'."
)
"""The system message of both built-in agents: asks for a final ``A: N`` line."""

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""The ``calculator`` tool in the chat-completions ``tools`` format."""

AGENT_PROGRAM = Path(__file__).parent / "envs" / "agent_program.py"
"""The built-in agent program: ``python agent_program.py QUESTION_FILE`` (stdlib
and ``openai`` only, so any interpreter with the SDK runs it), or ``main([QUESTION_FILE])``
in a warm worker; prints or returns the final assistant text."""


# --- in-process agent ----------------------------------------------------------


def run_calculator(arguments: str) -> str:
    """The tool's answer to a call's JSON ``arguments`` (``{"expression": ...}``),
    evaluated by :func:`lowwater.envs.calculator.evaluate` (never ``eval``;
    the agent program uses the same evaluator).  Errors become text the
    model sees, never exceptions."""
    return tool_answer(arguments)


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def function_tool(fn: Callable[..., Any]) -> dict[str, Any]:
    """A chat-completions ``tools`` entry for a plain Python function.

    The name is ``fn.__name__``, the description the docstring's first
    paragraph, and each parameter a property typed from its annotation
    (``str``, ``int``, ``float``, ``bool``, ``list``, ``dict``; anything
    else is left untyped); parameters without a default are required::

        def lookup(city: str, days: int = 1) -> str:
            \"\"\"Weather forecast for a city.\"\"\"

    Raises:
        TypeError: ``fn`` takes ``*args``/``**kwargs`` (no schema for them).
    """
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: leave parameters untyped
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__!r}: *args/**kwargs have no JSON schema")
        hint: Any = hints.get(name)
        kind = _JSON_TYPES.get(typing.get_origin(hint) or hint)
        properties[name] = {"type": kind} if kind else {}
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


async def _call_tool(tools: dict[str, Callable[..., Any]], call: dict[str, Any]) -> str:
    """A tool call's answer as text; every failure is text the model sees."""
    function = call.get("function") or {}
    fn = tools.get(function.get("name", ""))
    if fn is None:
        return f"error: no tool named {function.get('name')!r}"
    try:
        arguments = orjson.loads(function.get("arguments") or "{}")
        result = fn(**arguments)
        if inspect.isawaitable(result):
            result = await result
    except Exception as exc:  # the model sent bad arguments or the tool failed: tell it
        return f"error: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else orjson.dumps(result).decode()


async def chat_tool_loop(
    http: httpx.AsyncClient,
    base_url: str,
    api_key: str,
    question: str,
    *,
    model: str,
    max_turns: int,
    tools: Sequence[Callable[..., Any]] | None = None,
    system: str = SYSTEM_PROMPT,
) -> str:
    """Ask ``question`` with ``system``, answer tool calls, and return the
    first assistant text without tool calls.

    Args:
        http: the client to call with (in a harness: ``ctx.http``, whose read
            responses free their request bodies when dropped).
        base_url: the OpenAI-compatible base, ending in ``/v1`` (``ctx.base_url``).
        api_key: sent as ``Authorization: Bearer`` (``ctx.api_key``).
        question: the user message (``ctx.task.prompt``).
        model: the model name to put in requests (``ctx.model``).
        max_turns: model calls allowed (``ctx.max_turns``).
        tools: plain Python functions (sync or ``async``) offered as tools
            (:func:`function_tool`); a call's JSON arguments are passed as
            keywords and a non-string result is sent back as JSON.
            ``None``: the ``calculator`` tool.
        system: the system message (default :data:`SYSTEM_PROMPT`).

    Raises:
        RolloutFailed: ``model`` class for a non-200 answer or a reply
            without ``choices[0].message``; ``environment`` when
            ``max_turns`` calls brought no final answer.
        httpx.HTTPError: the call itself failed (classified ``model``).
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]
    table = None if tools is None else {fn.__name__: fn for fn in tools}
    specs = [CALCULATOR_TOOL] if tools is None else [function_tool(fn) for fn in tools]
    url = f"{base_url}/chat/completions"
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    for _ in range(max_turns):
        body = {"model": model, "messages": messages, "tools": specs}
        response = await http.post(url, content=orjson.dumps(body), headers=headers)
        if response.status_code != 200:
            raise RolloutFailed("model", f"model call answered {response.status_code}: {response.text[:200]}")
        try:
            message = orjson.loads(response.content)["choices"][0]["message"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise RolloutFailed("model", "model reply has no choices[0].message") from None
        tool_calls = message.get("tool_calls") or []
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        if not tool_calls:
            return message.get("content") or ""
        for call in tool_calls:
            if table is not None:
                result = await _call_tool(table, call)
            else:
                result = run_calculator(call.get("function", {}).get("arguments", "{}"))
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
    raise RolloutFailed("environment", f"no final answer after {max_turns} model calls")


# --- program agent ---------------------------------------------------------------


async def run_program_agent(ctx: HarnessContext, timeout_s: float | None = None) -> str:
    """Run :data:`AGENT_PROGRAM` for ``ctx.task.prompt`` in the rollout's
    runtime, pointed at the rollout's slot; its final text.

    The question goes to ``question.txt`` in the runtime's workdir; the slot
    (``OPENAI_*``/``ANTHROPIC_*``), ``LOWWATER_MODEL`` and
    ``LOWWATER_MAX_TURNS`` are set for the call only.  On a persistent
    runtime the program runs in a warm worker (the SDK is imported once per
    runtime, not once per rollout); on an ephemeral one it is a fresh
    process, as a third-party agent CLI would be.

    Args:
        ctx: the harness context.
        timeout_s: seconds before the program is killed; ``None``: no limit.

    Raises:
        RolloutFailed: ``model`` class when the program fails (its last
            words, at most 300 characters, in the message); ``infra`` when the
            engine has no runtime.
        lowwater.runtime.ProgramTimeout: ``timeout_s`` expired.
    """
    from lowwater.runtime import ScriptError

    runtime = await ctx.runtime()
    question_file = runtime.workdir / "question.txt"
    question_file.write_text(ctx.task.prompt, encoding="utf-8")
    env = ctx.program_env() | {"LOWWATER_MODEL": ctx.model, "LOWWATER_MAX_TURNS": str(ctx.max_turns)}
    try:
        return await ctx.run_script(AGENT_PROGRAM, [str(question_file)], env=env, timeout=timeout_s)
    except ScriptError as exc:
        raise RolloutFailed("model", f"agent program failed: {str(exc)[-300:]}") from None


async def run_calculator_agent(ctx: HarnessContext) -> str:
    """The built-in calculator agent as ``ctx.harness`` asks: :func:`run_program_agent`
    for ``"program"``, :func:`chat_tool_loop` over ``ctx.http`` otherwise.
    Returns the final assistant text (pass it to :func:`final_answer`).

    Raises:
        RolloutFailed: as the two functions do.
    """
    if ctx.harness == "program":
        return await run_program_agent(ctx)
    return await chat_tool_loop(
        ctx.http, ctx.base_url, ctx.api_key, ctx.task.prompt, model=ctx.model, max_turns=ctx.max_turns
    )


# --- answers ------------------------------------------------------------------------
# Recorded GSM8K solutions end in "A: N" and GSM8K references in "#### N"; agents
# are asked for "A: N".  Numbers may carry "$", "%", thousands separators or a
# trailing period.

_FINAL = re.compile(r"(?m)^\s*(?:A:|####)\s*(.*?)\s*$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def final_answer(text: str | None) -> str | None:
    """The text after the last ``A:`` or ``####`` marker line, stripped, or
    ``None`` when ``text`` is empty or has no such line."""
    if not text:
        return None
    matches = list(_FINAL.finditer(text))
    return matches[-1].group(1) if matches else None


def to_number(text: str | None) -> Fraction | None:
    """The first number in ``text`` (``$``, thousands separators, a fraction
    ``a/b`` allowed) as an exact :class:`~fractions.Fraction`, or ``None``."""
    if text is None:
        return None
    match = _NUMBER.search(text.replace("$", ""))
    if match is None:
        return None
    raw = match.group(0).replace(",", "")
    try:
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


def same_number(answer: str | None, reference: str | None) -> bool:
    """True if both contain a number (:func:`to_number`) and the numbers are
    exactly equal (``"1,050."`` equals ``"1050"``; ``"0.5"`` equals ``"1/2"``)."""
    a, b = to_number(answer), to_number(reference)
    return a is not None and b is not None and a == b
