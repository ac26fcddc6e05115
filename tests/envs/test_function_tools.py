"""lowwater.harness: tools from plain Python functions in the in-process chat loop."""

from __future__ import annotations

import httpx
import orjson
import pytest
import trio

from lowwater.harness import chat_tool_loop, function_tool


def forecast(city: str, days: int = 1, metric: bool = True) -> dict:
    """Weather forecast for a city.

    Longer notes the model does not need."""
    return {"city": city, "days": days, "metric": metric}


async def shout(text: str) -> str:
    """Upper-case text."""
    return text.upper()


def test_schema_from_signature_and_docstring():
    tool = function_tool(forecast)
    assert tool == {
        "type": "function",
        "function": {
            "name": "forecast",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
                "required": ["city"],
            },
        },
    }
    with pytest.raises(TypeError, match="no JSON schema"):
        function_tool(lambda *a: None)


def test_loop_calls_plain_functions_and_reports_their_errors():
    seen: list[list[dict]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        seen.append(body["messages"])
        assert [t["function"]["name"] for t in body["tools"]] == ["forecast", "shout"]
        calls = [
            {"id": "1", "function": {"name": "forecast", "arguments": '{"city": "Oslo", "days": 2}'}},
            {"id": "2", "function": {"name": "shout", "arguments": '{"text": "hi"}'}},
            {"id": "3", "function": {"name": "forecast", "arguments": '{"town": "x"}'}},
            {"id": "4", "function": {"name": "nope", "arguments": "{}"}},
        ]
        if len(seen) == 1:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
        else:
            message = {"role": "assistant", "content": "A: done"}
        return httpx.Response(200, json={"choices": [{"message": message}]})

    async def main() -> str:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
            return await chat_tool_loop(
                http, "http://x/v1", "k", "q", model="m", max_turns=3, tools=[forecast, shout], system="be brief"
            )

    assert trio.run(main) == "A: done"
    first, second = seen
    assert first[0] == {"role": "system", "content": "be brief"}
    results = [m["content"] for m in second if m["role"] == "tool"]
    assert orjson.loads(results[0]) == {"city": "Oslo", "days": 2, "metric": True}
    assert results[1] == "HI"
    assert results[2].startswith("error: TypeError")
    assert results[3] == "error: no tool named 'nope'"
