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

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SYSTEM_PROMPT = (
    "Solve the math word problem step by step. Use the calculator tool for every "
    "arithmetic step. Finish with a last line of the form 'A: <number>'."
)
TOOL = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


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


def main() -> int:
    import openai

    with open(sys.argv[1], encoding="utf-8") as f:
        question = f.read()
    model = os.environ.get("LOWWATER_MODEL", "scripted")
    max_turns = int(os.environ.get("LOWWATER_MAX_TURNS", "16"))
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[TOOL])
        except openai.OpenAIError as exc:
            print(f"model call failed: {exc}", file=sys.stderr)
            return 1
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not calls:
            print(message.content or "")
            return 0
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    print(f"no final answer after {max_turns} model calls", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
