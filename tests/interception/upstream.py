"""A scripted upstream for the interception tests: the three protocols, streamed and not.

Answers ``echo: <last user text>`` in word pieces (optionally ending in a
``calculator`` tool call), with token ids and logprobs when asked, and knobs
for the failures the proxy must survive: latency, queued error statuses,
a stream cut after ``n`` events, a hang until the client leaves, malformed
answers.  It records what it received and how many clients left mid-answer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import orjson
import trio
import trio.lowlevel

from lowwater.http import HTTPError, handle, read_body, send_json

Json = dict[str, Any]


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class Upstream:
    """The app and its knobs (set attributes between calls).

    Attributes:
        latency_s: sleep before answering.
        statuses: queued error statuses, one consumed per request (429 gets
            ``retry-after: <retry_after>``).
        retry_after: the ``retry-after`` value sent with a 429 (default ``"0"``).
        cut_after: if set, a stream is broken off after this many events.
        hang_after: if set, a stream stops after this many events and waits
            until the client leaves (counted in ``disconnects``).
        hang: never answer; wait until the client leaves (counted in ``disconnects``).
        malformed: answer 200 with a body that is not JSON (non-stream) or
            an event whose data is not JSON (stream).
        tool_call: end each answer with a ``calculator`` tool call.
        received: ``(path, headers, body)`` of every request.
        disconnects: clients that left before the answer was complete.
        entered: set when a request arrived (for tests that act mid-call).
    """

    def __init__(self) -> None:
        self.latency_s = 0.0
        self.statuses: deque[int] = deque()
        self.retry_after = "0"
        self.cut_after: int | None = None
        self.hang_after: int | None = None
        self.hang = False
        self.malformed = False
        self.tool_call = False
        self.received: list[tuple[str, dict[str, str], Json]] = []
        self.disconnects = 0
        self.entered = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await handle(scope, receive, send, self._route)

    async def _route(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"]
        if path == "/v1/models":
            return await send_json(send, 200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})
        body = orjson.loads(await read_body(scope, receive, 1 << 30))
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.received.append((path, headers, body))
        self.entered.set()
        if self.statuses:
            status = self.statuses.popleft()
            extra = [(b"retry-after", self.retry_after.encode())] if status == 429 else []
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-type", b"application/json"), *extra],
                }
            )
            return await send(
                {"type": "http.response.body", "body": orjson.dumps({"error": {"message": f"scripted {status}"}})}
            )
        if self.hang:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnects += 1
            return
        if self.latency_s:
            await trio.sleep(self.latency_s)
        kind = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}.get(path)
        if kind is None:
            raise HTTPError(404, f"no route {path}")
        answer = _Answer(kind, body, self.tool_call)
        if not body.get("stream"):
            if self.malformed:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
                )
                return await send({"type": "http.response.body", "body": b"{not json"})
            return await send_json(send, 200, answer.body())
        await self._stream(receive, send, answer.events())

    async def _stream(self, receive: Any, send: Any, events: list[bytes]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnects += 1
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            for i, event in enumerate(events):
                if self.cut_after is not None and i >= self.cut_after:
                    nursery.cancel_scope.cancel()
                    return  # returning mid-body: hypercorn drops the connection
                if self.hang_after is not None and i >= self.hang_after:
                    await trio.sleep_forever()  # until watch() sees the client leave
                if self.malformed and i == 1:
                    event = b"data: {not json\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await trio.lowlevel.checkpoint()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()


class _Answer:
    """The deterministic answer to one request, in each protocol's shape."""

    def __init__(self, kind: str, body: Json, tool_call: bool) -> None:
        self.kind = kind
        self.model = body.get("model", "")
        messages = body.get("messages") if kind != "responses" else body.get("input")
        if isinstance(messages, str):
            question = messages
        else:
            users = [m for m in messages or [] if isinstance(m, dict) and m.get("role") == "user"]
            question = _text_of(users[-1].get("content")) if users else ""
        self.pieces = ["echo:"] + [" " + w for w in question.split()[:8]]
        self.text = "".join(self.pieces)
        self.ids = [1000 + i for i in range(len(self.pieces))]
        self.lps = [-0.5 * (i + 1) for i in range(len(self.pieces))]
        self.tool_call = tool_call
        self.logprobs = bool(body.get("logprobs")) or "message.output_text.logprobs" in (body.get("include") or [])
        self.token_ids = bool(body.get("return_token_ids"))

    def _entries(self, sl: slice = slice(None)) -> list[Json]:
        return [
            {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(self.pieces[sl], self.lps[sl])
        ]

    def usage(self) -> Json:
        n = len(self.pieces)
        if self.kind == "messages":
            return {"input_tokens": 7, "output_tokens": n}
        if self.kind == "responses":
            return {"input_tokens": 7, "output_tokens": n, "total_tokens": 7 + n}
        return {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}

    def body(self) -> Json:
        if self.kind == "chat":
            message: Json = {"role": "assistant", "content": self.text}
            if self.tool_call:
                message["tool_calls"] = [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
                    }
                ]
            choice: Json = {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if self.tool_call else "stop",
                "logprobs": {"content": self._entries()} if self.logprobs else None,
            }
            if self.token_ids:
                choice["token_ids"] = self.ids
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(),
            }
        if self.kind == "messages":
            content: list[Json] = [{"type": "text", "text": self.text}]
            if self.tool_call:
                content.append(
                    {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "1+1"}}
                )
            return {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": content,
                "stop_reason": "tool_use" if self.tool_call else "end_turn",
                "stop_sequence": None,
                "usage": self.usage(),
            }
        return self._response("completed", self._output())

    def _output(self) -> list[Json]:
        part = {
            "type": "output_text",
            "text": self.text,
            "annotations": [],
            "logprobs": self._entries() if self.logprobs else [],
        }
        out: list[Json] = [
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [part]}
        ]
        if self.tool_call:
            out.append(
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "calculator",
                    "arguments": '{"expression": "1+1"}',
                    "status": "completed",
                }
            )
        return out

    def _response(self, status: str, output: list[Json]) -> Json:
        return {
            "id": "resp_1",
            "object": "response",
            "created_at": 0,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "temperature": 1.0,
            "usage": self.usage() if status != "in_progress" else None,
        }

    def events(self) -> list[bytes]:
        return {"chat": self._chat_events, "messages": self._messages_events, "responses": self._responses_events}[
            self.kind
        ]()

    def _chat_events(self) -> list[bytes]:
        def chunk(delta: Json, finish: str | None = None, i: int | None = None) -> bytes:
            choice: Json = {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": {"content": self._entries(slice(i, i + 1))} if self.logprobs and i is not None else None,
            }
            if self.token_ids and i is not None:
                choice["token_ids"] = self.ids[i : i + 1]
            return _sse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": self.model,
                    "choices": [choice],
                }
            )

        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({"content": p}, i=i) for i, p in enumerate(self.pieces)]
        if self.tool_call:
            out.append(
                chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "calculator", "arguments": ""},
                            }
                        ]
                    }
                )
            )
            out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": "1+1"}'}}]}))
        out.append(chunk({}, "tool_calls" if self.tool_call else "stop"))
        out.append(
            _sse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage(),
                }
            )
        )
        out.append(_sse("[DONE]"))
        return out

    def _messages_events(self) -> list[bytes]:
        start = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 7, "output_tokens": 1},
        }
        out = [_sse({"type": "message_start", "message": start}, "message_start"), _sse({"type": "ping"}, "ping")]
        out.append(
            _sse(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            )
        )
        out += [
            _sse(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}},
                "content_block_delta",
            )
            for p in self.pieces
        ]
        out.append(_sse({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        if self.tool_call:
            out.append(
                _sse(
                    {
                        "type": "content_block_start",
                        "index": 1,
                        "content_block": {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {}},
                    },
                    "content_block_start",
                )
            )
            out.append(
                _sse(
                    {
                        "type": "content_block_delta",
                        "index": 1,
                        "delta": {"type": "input_json_delta", "partial_json": '{"expression": "1+1"}'},
                    },
                    "content_block_delta",
                )
            )
            out.append(_sse({"type": "content_block_stop", "index": 1}, "content_block_stop"))
        out.append(
            _sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "tool_use" if self.tool_call else "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": len(self.pieces)},
                },
                "message_delta",
            )
        )
        out.append(_sse({"type": "message_stop"}, "message_stop"))
        return out

    def _responses_events(self) -> list[bytes]:
        seq = iter(range(1000))

        def ev(kind: str, **fields: Any) -> bytes:
            return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

        output = self._output()
        message = output[0]
        part = message["content"][0]
        out = [
            ev("response.created", response=self._response("in_progress", [])),
            ev("response.in_progress", response=self._response("in_progress", [])),
            ev("response.output_item.added", output_index=0, item={**message, "status": "in_progress", "content": []}),
            ev(
                "response.content_part.added",
                item_id="msg_1",
                output_index=0,
                content_index=0,
                part={**part, "text": "", "logprobs": []},
            ),
        ]
        out += [
            ev(
                "response.output_text.delta",
                item_id="msg_1",
                output_index=0,
                content_index=0,
                delta=p,
                logprobs=part["logprobs"][i : i + 1],
            )
            for i, p in enumerate(self.pieces)
        ]
        out += [
            ev(
                "response.output_text.done",
                item_id="msg_1",
                output_index=0,
                content_index=0,
                text=self.text,
                logprobs=part["logprobs"],
            ),
            ev("response.content_part.done", item_id="msg_1", output_index=0, content_index=0, part=part),
            ev("response.output_item.done", output_index=0, item=message),
        ]
        if self.tool_call:
            call = output[1]
            out += [
                ev(
                    "response.output_item.added",
                    output_index=1,
                    item={**call, "arguments": "", "status": "in_progress"},
                ),
                ev("response.function_call_arguments.delta", item_id="fc_1", output_index=1, delta=call["arguments"]),
                ev(
                    "response.function_call_arguments.done",
                    item_id="fc_1",
                    output_index=1,
                    name="calculator",
                    arguments=call["arguments"],
                ),
                ev("response.output_item.done", output_index=1, item=call),
            ]
        out.append(ev("response.completed", response=self._response("completed", output)))
        return out
