"""The built-in agent *program*: the same calculator loop as an external process.

Run inside a runtime as ``python agent_program.py QUESTION_FILE`` with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` pointing at the rollout's
interception slot, exactly as a third-party agent CLI would be.  It uses the
official ``openai`` SDK, prints the final assistant text on stdout and exits
0; a failed model call exits 1 with the reason on stderr.

Stdlib + ``openai`` only: it must not import lowwater (the runtime's
interpreter need not have it).  The calculator is the in-process agent's
own, ``calculator.py`` beside this file (stdlib only), loaded by path: a
copy kept here once lacked its bounds, crashed on ``((9**99)**99)**99`` and
burned 20 s of CPU one level deeper.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any


def _load_calculator() -> Any:
    """``calculator.py`` from this file's directory, as a module of its own (not ``lowwater.envs``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calculator.py")
    spec = importlib.util.spec_from_file_location("_lowwater_agent_calculator", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CALCULATOR = _load_calculator()
SYSTEM_PROMPT = (
    "Solve the math word problem step by step. Use the calculator tool for every "
    "arithmetic step. Finish with a last line of the form 'A: <number>'."
)
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def calculator(arguments: str) -> str:
    """The tool's answer to a call's JSON ``arguments``: the shared evaluator's
    ``tool_answer`` (errors are text the model sees and may act on)."""
    return str(_CALCULATOR.tool_answer(arguments))


_HTTP = None  # one connection pool per process (a warm worker serves many rollouts)


class AgentError(Exception):
    """The loop failed: a model call failed, or no final answer in time."""


def solve(question: str) -> str:
    """The calculator loop with the official SDK; the final assistant text.

    The client is built per call from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``
    (the rollout's slot), so a warm worker serving many rollouts never reuses
    one rollout's endpoint for another.

    Raises:
        AgentError: a model call failed, or ``LOWWATER_MAX_TURNS`` ran out.
    """
    import openai

    global _HTTP
    model = os.environ.get("LOWWATER_MODEL", "scripted")
    max_turns = int(os.environ.get("LOWWATER_MAX_TURNS", "16"))
    if _HTTP is None:
        import httpx

        _HTTP = httpx.Client(timeout=600.0)
    # The endpoint and key are the rollout's (read from the environment
    # now); only the connection pool is shared across a warm worker's calls.
    # A client of its own per rollout cost 21 ms of CPU (an SSL context),
    # more than the rest of a GSM8K rollout's agent work.
    client = openai.OpenAI(max_retries=0, http_client=_HTTP)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[TOOL])
        except openai.OpenAIError as exc:
            raise AgentError(f"model call failed: {exc}") from None
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not calls:
            return message.content or ""
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    raise AgentError(f"no final answer after {max_turns} model calls")


def main(argv: list[str]) -> str:
    """Warm-worker entry (``Runtime.run_script(..., warm=True)``): ``argv[0]``
    is the question file; returns the final text.  A persistent runtime
    imports the SDK once instead of once per rollout (about 0.6 s of CPU,
    3 s on a busy two-core machine)."""
    with open(argv[0], encoding="utf-8") as f:
        return solve(f.read())


def cli() -> int:
    """``python agent_program.py QUESTION_FILE``: prints the final text; exit 1 on failure."""
    try:
        print(main(sys.argv[1:2]))
    except AgentError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
