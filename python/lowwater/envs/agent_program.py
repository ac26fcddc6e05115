"""The built-in agent *program*: the same calculator loop as an external process.

Run inside a runtime as ``python agent_program.py QUESTION_FILE`` with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` pointing at the rollout's
interception slot, exactly as a third-party agent CLI would be.  It uses the
official ``openai`` SDK, prints the final assistant text on stdout and exits
0; a failed model call exits 1 with the reason on stderr.

Stdlib + ``openai`` only: it must not import lowwater (the runtime's
interpreter need not have it), so the calculator is repeated here in the
same restricted form (``ast``, numbers and arithmetic operators only).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
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


def calc(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = calc(node.left), calc(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = calc(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    raise ValueError("not arithmetic")


def calculator(arguments: str) -> str:
    try:
        expression = str(json.loads(arguments)["expression"]).replace(",", "")
        if len(expression) > 256:
            return "error: expression too long"
        value = calc(ast.parse(expression, mode="eval").body)
    except Exception as exc:  # the model sees the error and may try again
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


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
