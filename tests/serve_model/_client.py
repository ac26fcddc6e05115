"""A minimal tool-using agent for each protocol, over raw HTTP, for the serve-model tests.

Each protocol has a request builder, a reader for a non-streamed body and a
reader for an SSE stream (which checks the protocol's event order), all
reducing a response to a :class:`Turn`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio

from _sdk_agents import CHAT_TOOLS, MESSAGES_TOOLS, RESPONSES_TOOLS, calculate
from lowwater.serve_model import ReplayModel, serve_model

# The recorded GPT-3 solutions beside this checkout (never copied into the repo).
SOLUTIONS = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "example_model_solutions.jsonl"
requires_data = pytest.mark.skipif(
    not SOLUTIONS.exists(),
    reason="GSM8K data not found beside the checkout (../shared/data/gsm8k; see the README's GSM8K section)",
)
PROTOCOLS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@functools.cache
def gsm8k_rows() -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in SOLUTIONS.read_bytes().splitlines()]


@functools.cache
def several_step_row() -> dict[str, Any]:
    """The first row whose recorded 175B-verification solution takes at least four calculator steps."""
    return next(r for r in gsm8k_rows() if r["175b_verification"]["solution"].count(">>") >= 4)


@functools.cache
def replay_model(column: str = "175b_verification") -> ReplayModel:
    return ReplayModel.from_jsonl(SOLUTIONS, column)


@attrs.define
class Turn:
    text: str
    finish: str  # "stop" | "tool" | "length"
    call_id: str | None = None
    expression: str | None = None
    arguments: str | None = None
    usage: dict[str, int] = attrs.field(factory=dict)  # {"prompt": p, "completion": c}
    payload: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    raw: Any = None


def run_with_server(model: Any, fn: Any) -> Any:
    """``trio.run`` a server for ``model`` and ``await fn(url, client)``; returns its result."""

    async def main() -> Any:
        async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
            url = await nursery.start(serve_model, model)
            try:
                return await fn(url, client)
            finally:
                nursery.cancel_scope.cancel()

    return trio.run(main)


# --- conversations --------------------------------------------------------------


def start(protocol: str, question: str, *, tools: bool = True, **extra: Any) -> dict[str, Any]:
    """A first request body for ``question`` (with an instruction before it, as agents do)."""
    system = "Solve the problem. Use the calculator tool for arithmetic. End with a line 'A: <number>'."
    if protocol == "chat":
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        }
        if tools:
            body["tools"] = CHAT_TOOLS
    elif protocol == "responses":
        body = {"model": "m", "instructions": system, "input": [{"role": "user", "content": question}]}
        if tools:
            body["tools"] = RESPONSES_TOOLS
    else:
        body = {"model": "m", "max_tokens": 4096, "system": system, "messages": [{"role": "user", "content": question}]}
        if tools:
            body["tools"] = MESSAGES_TOOLS
    if protocol == "chat" and extra.get("stream"):
        # Without it a streamed chat completion has no usage, as upstream.
        body["stream_options"] = {"include_usage": True}
    return {**body, **extra}


def append(protocol: str, body: dict[str, Any], turn: Turn, result: str) -> None:
    """Add ``turn`` (which ended with a tool call) and the tool's ``result`` to the conversation."""
    if protocol == "chat":
        body["messages"] += [
            {
                "role": "assistant",
                "content": turn.text or None,
                "tool_calls": [
                    {
                        "id": turn.call_id,
                        "type": "function",
                        "function": {"name": "calculator", "arguments": turn.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": turn.call_id, "content": result},
        ]
    elif protocol == "responses":
        if turn.text:
            body["input"].append(
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": turn.text}]}
            )
        body["input"] += [
            {"type": "function_call", "call_id": turn.call_id, "name": "calculator", "arguments": turn.arguments},
            {"type": "function_call_output", "call_id": turn.call_id, "output": result},
        ]
    else:
        content: list[dict[str, Any]] = [{"type": "text", "text": turn.text}] if turn.text else []
        content.append(
            {"type": "tool_use", "id": turn.call_id, "name": "calculator", "input": {"expression": turn.expression}}
        )
        body["messages"] += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": turn.call_id, "content": result}]},
        ]


async def request(client: httpx.AsyncClient, url: str, protocol: str, body: dict[str, Any]) -> Turn:
    """Send ``body``; read the answer (SSE if ``body["stream"]``) into a :class:`Turn`; assert 200."""
    r = await client.post(url + PATHS[protocol], json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        return STREAM_READERS[protocol](sse_events(r.text))
    return BODY_READERS[protocol](r.json())


async def walk(client: httpx.AsyncClient, url: str, protocol: str, question: str, **extra: Any) -> list[Turn]:
    """Run the whole tool-use conversation for ``question``; the turns in order."""
    body = start(protocol, question, **extra)
    turns = []
    for _ in range(100):
        turn = await request(client, url, protocol, body)
        turns.append(turn)
        if turn.finish != "tool":
            return turns
        append(protocol, body, turn, calculate(turn.expression))
    raise AssertionError("no final turn after 100 calls")


# --- readers -----------------------------------------------------------------------


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) for each SSE event of ``text``."""
    events = []
    assert text.endswith("\n\n"), "a stream ends with a complete event"
    for block in text.split("\n\n")[:-1]:
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            else:
                assert field == "data", line
                data.append(value)
        events.append((name, "\n".join(data)))
    return events


def _expression(arguments: str) -> str:
    args = orjson.loads(arguments)
    assert set(args) == {"expression"}
    return args["expression"]


def read_chat(body: dict[str, Any]) -> Turn:
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    message = choice["message"]
    finish = {"stop": "stop", "tool_calls": "tool", "length": "length"}[choice["finish_reason"]]
    turn = Turn(
        message["content"] or "",
        finish,
        payload=body.get("x_lowwater_payload"),
        logprobs=(choice["logprobs"] or {}).get("content"),
        raw=body,
        usage={"prompt": body["usage"]["prompt_tokens"], "completion": body["usage"]["completion_tokens"]},
    )
    calls = message.get("tool_calls") or []
    assert len(calls) == (finish == "tool")
    if calls:
        turn.call_id, turn.arguments = calls[0]["id"], calls[0]["function"]["arguments"]
        turn.expression = _expression(turn.arguments)
    return turn


def read_chat_stream(events: list[tuple[str | None, str]]) -> Turn:
    assert events[-1] == (None, "[DONE]")
    chunks = [orjson.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text, finish, call_id, arguments, logprobs, usage, payload = [], None, None, None, [], {}, None
    for c in chunks:
        if c.get("usage"):
            usage = {"prompt": c["usage"]["prompt_tokens"], "completion": c["usage"]["completion_tokens"]}
        payload = c.get("x_lowwater_payload", payload)
        for choice in c["choices"]:
            assert finish is None, "nothing after the finish reason but usage"
            delta = choice["delta"]
            text.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                call_id = tc.get("id", call_id)
                arguments = (arguments or "") + tc["function"].get("arguments", "")
            if choice["logprobs"]:
                logprobs += choice["logprobs"]["content"]
            finish = choice["finish_reason"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = {"stop": "stop", "tool_calls": "tool", "length": "length"}[finish]
    turn = Turn("".join(text), finish, call_id, None, arguments, usage, payload, logprobs or None, chunks)
    if arguments is not None:
        turn.expression = _expression(arguments)
    return turn


def read_messages(body: dict[str, Any]) -> Turn:
    assert body["type"] == "message" and body["role"] == "assistant"
    finish = {"end_turn": "stop", "tool_use": "tool", "max_tokens": "length"}[body["stop_reason"]]
    texts = [b["text"] for b in body["content"] if b["type"] == "text"]
    uses = [b for b in body["content"] if b["type"] == "tool_use"]
    assert len(uses) == (finish == "tool")
    turn = Turn(
        "".join(texts),
        finish,
        payload=body.get("x_lowwater_payload"),
        raw=body,
        usage={"prompt": body["usage"]["input_tokens"], "completion": body["usage"]["output_tokens"]},
    )
    if uses:
        turn.call_id, turn.expression = uses[0]["id"], uses[0]["input"]["expression"]
        turn.arguments = orjson.dumps(uses[0]["input"]).decode()
    return turn


def read_messages_stream(events: list[tuple[str | None, str]]) -> Turn:
    data = [orjson.loads(d) for _, d in events]
    assert all(name == d["type"] for (name, _), d in zip(events, data))
    names = [d["type"] for d in data]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    text, call_id, expression, partial, current = [], None, None, "", None
    for d in data:
        if d["type"] == "content_block_start":
            assert current is None, "blocks do not nest"
            current = d["index"]
            if d["content_block"]["type"] == "tool_use":
                call_id = d["content_block"]["id"]
        elif d["type"] == "content_block_delta":
            assert d["index"] == current
            if d["delta"]["type"] == "text_delta":
                text.append(d["delta"]["text"])
            else:
                partial += d["delta"]["partial_json"]
        elif d["type"] == "content_block_stop":
            assert d["index"] == current
            current = None
    if call_id:
        expression = _expression(partial)
    final = data[-2]
    finish = {"end_turn": "stop", "tool_use": "tool", "max_tokens": "length"}[final["delta"]["stop_reason"]]
    usage = {"prompt": data[0]["message"]["usage"]["input_tokens"], "completion": final["usage"]["output_tokens"]}
    return Turn(
        "".join(text), finish, call_id, expression, partial or None, usage, final.get("x_lowwater_payload"), raw=data
    )


def read_responses(body: dict[str, Any]) -> Turn:
    assert body["object"] == "response"
    messages = [i for i in body["output"] if i["type"] == "message"]
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    parts = [p for m in messages for p in m["content"]]
    finish = "length" if body["status"] == "incomplete" else "tool" if calls else "stop"
    assert body["status"] in ("completed", "incomplete")
    logprobs = [lp for p in parts for lp in p.get("logprobs") or []]
    turn = Turn(
        "".join(p["text"] for p in parts),
        finish,
        payload=body.get("x_lowwater_payload"),
        logprobs=logprobs or None,
        raw=body,
        usage={"prompt": body["usage"]["input_tokens"], "completion": body["usage"]["output_tokens"]},
    )
    if calls:
        turn.call_id, turn.arguments = calls[0]["call_id"], calls[0]["arguments"]
        turn.expression = _expression(turn.arguments)
    return turn


def read_responses_stream(events: list[tuple[str | None, str]]) -> Turn:
    data = [orjson.loads(d) for _, d in events]
    assert all(name == d["type"] for (name, _), d in zip(events, data))
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert data[0]["type"] == "response.created" and data[-1]["type"] in ("response.completed", "response.incomplete")
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    done_texts = [d["text"] for d in data if d["type"] == "response.output_text.done"]
    assert deltas == "".join(done_texts)
    args = "".join(d["delta"] for d in data if d["type"] == "response.function_call_arguments.delta")
    turn = read_responses(data[-1]["response"])
    assert turn.text == deltas and (turn.arguments or "") == args
    turn.raw = data
    return turn


BODY_READERS = {"chat": read_chat, "responses": read_responses, "messages": read_messages}
STREAM_READERS = {"chat": read_chat_stream, "responses": read_responses_stream, "messages": read_messages_stream}
