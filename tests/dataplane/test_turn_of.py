"""turn_of reads a record's answer with the record's protocol, and reports
what it cannot read with the Python server's wording (records stand in as
plain objects with a TurnRecord's attributes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson

from lowwater.interception.dataplane import turn_of
from lowwater.trajectory import Trajectory


def record(
    protocol: str,
    response: bytes,
    *,
    streamed: bool = False,
    status: int = 200,
    error: Any = None,
    tools: bytes | None = None,
) -> Any:
    return SimpleNamespace(
        protocol=protocol,
        model="m",
        streamed=streamed,
        kept=0,
        previous=0,
        messages=(b'{"role":"user","content":"hi"}',),
        status=status,
        response=response,
        error=error,
        tools=tools,
        started_s=0.0,
        duration_s=0.01,
    )


def sse(*events: tuple[str | None, Any]) -> bytes:
    out = b""
    for name, data in events:
        head = f"event: {name}\n".encode() if name else b""
        out += head + b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"
    return out


def test_a_whole_anthropic_answer() -> None:
    answer = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "4"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    turn = turn_of(record("anthropic.messages", orjson.dumps(answer)), Trajectory("r"))
    assert turn.error is None and turn.finish_reason == "end_turn" and turn.usage == answer["usage"]
    assert turn.request_delta == [{"role": "user", "content": "hi"}]


def test_a_streamed_chat_answer_with_a_tool_call() -> None:
    raw = sse(
        (
            None,
            {
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "calc"}}]}}
                ]
            },
        ),
        (None, {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}),
        (None, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        (None, b"[DONE]"),
    )
    turn = turn_of(record("openai.chat", raw, streamed=True), Trajectory("r"))
    assert turn.error is None and turn.finish_reason == "tool_calls"
    assert turn.completion["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    ]


def test_what_cannot_be_read_is_an_error_not_an_answer() -> None:
    cut = sse((None, {"choices": [{"index": 0, "delta": {"content": "par"}}]}))
    cases = {
        "upstream answered 429": record("openai.chat", b'{"error": {}}', status=429),
        "upstream stream ended before its terminal event": record("openai.chat", cut, streamed=True),
        "upstream: ConnectError": record("openai.chat", b"", status=502, error="upstream: ConnectError"),
    }
    for expected, rec in cases.items():
        turn = turn_of(rec, Trajectory("r"))
        assert turn.error == expected
    malformed = turn_of(record("openai.chat", b"not json"), Trajectory("r"))
    assert malformed.completion is None and malformed.error.startswith("upstream answer malformed: ")
    unknown = turn_of(record("plugin.proto", b"{}"), Trajectory("r"))  # a protocol this table does not know
    assert unknown.completion is None and unknown.error is None


def test_credentials_in_an_error_are_redacted() -> None:
    turn = turn_of(
        record("openai.chat", b"", status=502, error="upstream: http://u:p@host/v1 refused"), Trajectory("r")
    )
    assert turn.error == "upstream: http://***@host/v1 refused"


def test_tools_are_read_by_the_protocol_and_interned() -> None:
    trajectory = Trajectory("r")
    legacy = turn_of(record("openai.chat", b"{}", tools=b'{"functions":[{"name":"f"}]}'), trajectory)
    assert legacy.tools == [{"type": "function", "function": {"name": "f"}}], "chat's deprecated functions"
    tools = b'{"tools":[{"name":"t","input_schema":{}}]}'
    one = turn_of(record("anthropic.messages", b"{}", tools=tools), trajectory)
    two = turn_of(record("anthropic.messages", b"{}", tools=tools), trajectory)
    assert one.tools == [{"name": "t", "input_schema": {}}] and two.tools is one.tools
    # What is not a non-empty list is no tools, as the Python server reads it.
    for odd in (b'{"tools":[]}', b'{"tools":"x"}', b"[1]"):
        assert turn_of(record("openai.chat", b"{}", tools=odd), trajectory).tools is None
