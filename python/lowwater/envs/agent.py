"""The built-in in-process agent: a chat-completions tool-calling loop.

Calls the rollout's interception slot (``ctx.base_url``) with the shared
``httpx.AsyncClient``, offers the ``calculator`` tool, evaluates tool calls
with :func:`lowwater.envs.calculator.evaluate` (never ``eval``), and stops at
the first reply without tool calls or after ``max_turns`` model calls.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from lowwater.envs.calculator import CalculatorError, evaluate, format_result
from lowwater.rollout import RolloutFailed

SYSTEM_PROMPT = (
    "Solve the math word problem step by step. Use the calculator tool for every "
    "arithmetic step. Finish with a last line of the form 'A: <number>'."
)

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


def run_calculator(arguments: str) -> str:
    """The tool's answer to a call's JSON ``arguments`` (errors become text the model sees)."""
    try:
        expression = orjson.loads(arguments)["expression"]
        return format_result(evaluate(str(expression)))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "error: arguments must be a JSON object with an 'expression' string"
    except CalculatorError as exc:
        return f"error: {exc}"


async def chat_tool_loop(
    http: httpx.AsyncClient, base_url: str, api_key: str, question: str, *, model: str, max_turns: int
) -> str:
    """Run the loop and return the final assistant text.

    Raises:
        RolloutFailed: ``model`` class for a non-2xx answer or a reply
            without a message; ``environment`` when ``max_turns`` runs out.
    """
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    url = f"{base_url}/chat/completions"
    headers = {"authorization": f"Bearer {api_key}"}
    for _ in range(max_turns):
        body = {"model": model, "messages": messages, "tools": [CALCULATOR_TOOL]}
        response = await http.post(
            url, content=orjson.dumps(body), headers=headers | {"content-type": "application/json"}
        )
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
            result = run_calculator(call.get("function", {}).get("arguments", "{}"))
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
    raise RolloutFailed("environment", f"no final answer after {max_turns} model calls")
