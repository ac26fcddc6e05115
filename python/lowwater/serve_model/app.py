"""The ASGI app of ``serve-model``: OpenAI chat completions, OpenAI responses, Anthropic messages.

Routes: ``POST /v1/chat/completions``, ``POST /v1/responses``,
``POST /v1/messages`` (each streamed as SSE in the protocol's own event
format when the body says ``"stream": true``) and ``GET /v1/models``.
Authentication headers are accepted and ignored; any ``model`` name is
served and echoed back.

Every request is reduced to the same question: the text of the last user
message (the *question*), how many tool results follow it, and whether a
``calculator`` tool is offered.  The model (:class:`~.scripted.ScriptedModel`
or :class:`~.replay.ReplayModel`) answers with a :class:`~.replay.Reply`
(text and maybe one tool call), which is then rendered in the protocol.
The server keeps no state between requests.

Errors are answered in the protocol's own error shape with status 400
(malformed JSON, missing or mistyped fields, unknown question, more tool
results than the solution has steps), 404 (unknown path), 405 (wrong
method) or 413 (body over ``max_body_bytes``).

Token accounting and logprobs are fake but deterministic (see
:mod:`.tokens`).  Chat completions return ``logprobs`` when asked
(``"logprobs": true``, ``top_logprobs``), spell tokens as ``token_id:N`` with
vLLM's ``"return_tokens_as_token_ids": true``, and add vLLM's
``prompt_token_ids``/``token_ids`` with ``"return_token_ids": true``; the
responses API returns logprobs with
``"include": ["message.output_text.logprobs"]``.  Logprobs cover the text;
``completion_tokens`` also counts the tool call's arguments.

With ``payload_bytes`` set on the model, every response carries an
``x_lowwater_payload`` string of that many bytes: at the top level of a
non-streamed body, and in a streamed response on the chunk with
``finish_reason`` (chat), on ``message_delta`` (messages) and in the response of
``response.completed`` (responses).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import trio

from lowwater.http import (
    App,
    HTTPError,
    Receive,
    Router,
    Scope,
    Send,
    parse_json,
    read_body,
    require_key,
    send_json,
    start_response,
)
from lowwater.http.routes import normalise
from lowwater.serve_model.render import (
    Render,
    chat_body,
    chat_events,
    complete,
    error_body,
    messages_body,
    messages_events,
    payload_text,
    responses_body,
    responses_events,
)
from lowwater.serve_model.replay import ModelError, Reply
from lowwater.serve_model.requests import Call, Json, parse_chat, parse_messages, parse_responses

MAX_BODY_BYTES = 64 << 20


class Model(Protocol):
    """What the app needs of a model (both built-in models satisfy it)."""

    name: str
    latency_s: float
    payload_bytes: int

    def reply(self, question: str, tool_results: int, *, tools: bool = True) -> Reply: ...


_Parser = Callable[[Any], Call]
Renderer = Callable[[Render], Json]
_Streamer = Callable[[Render], Iterator[bytes]]

PROTOCOLS: dict[str, tuple[str, _Parser, Renderer, _Streamer]] = {
    "/v1/chat/completions": ("openai", parse_chat, chat_body, chat_events),
    "/v1/responses": ("openai", parse_responses, responses_body, responses_events),
    "/v1/messages": ("anthropic", parse_messages, messages_body, messages_events),
}

STREAM_WRITE_BYTES = 16 << 10


async def stream_events(receive: Receive, send: Send, events: Iterator[bytes]) -> None:
    """Send ``events`` as an SSE response; stop early if the client leaves.

    Events are coalesced into writes of about :data:`STREAM_WRITE_BYTES`
    (one write per tiny event made the server, not the proxy under test,
    the bottleneck), except the terminal event (``[DONE]``,
    ``message_stop``, ``response.completed``), which always travels in a
    write of its own, as it does from a real server.  hypercorn turns writes
    after a disconnect into no-ops, so a watcher stops the stream instead.
    """
    async with trio.open_nursery() as nursery:

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch_disconnect)
        await start_response(send, 200, "text/event-stream", [("cache-control", "no-cache")])
        pending: list[bytes] = []
        size = 0
        previous = None
        for data in events:
            if previous is not None:
                pending.append(previous)
                size += len(previous)
                if size >= STREAM_WRITE_BYTES:
                    await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
                    pending, size = [], 0
            previous = data
        if pending:
            await send({"type": "http.response.body", "body": b"".join(pending), "more_body": True})
        await send({"type": "http.response.body", "body": previous or b"", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        nursery.cancel_scope.cancel()


def build_app(model: Model, *, max_body_bytes: int = MAX_BODY_BYTES, admin_key: str | None = None) -> App:
    """The ASGI app serving ``model`` (see the module docstring for routes and formats).

    ``max_body_bytes`` bounds a request body (413 past it).  The payload
    string, if any, is built once here and shared by every response.
    ``admin_key``: every request must carry it (``Authorization: Bearer`` or
    ``x-api-key``; 401 otherwise), as a server bound beyond loopback must.
    """
    payload = payload_text(model.payload_bytes)
    numbers = itertools.count(1)
    models_body = {
        "object": "list",
        "data": [
            {
                "id": model.name,
                "object": "model",
                "type": "model",
                "created": 0,
                "created_at": "1970-01-01T00:00:00Z",
                "owned_by": "lowwater",
                "display_name": model.name,
            }
        ],
        "has_more": False,
        "first_id": model.name,
        "last_id": model.name,
    }

    async def models(scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, models_body)

    async def generate(scope: Scope, receive: Receive, send: Send) -> None:
        _, parse, render, stream = PROTOCOLS[normalise(scope["path"])]
        call = parse(parse_json(await read_body(scope, receive, max_body_bytes)))
        try:
            reply = model.reply(call.question, call.tool_results, tools=call.tools)
        except ModelError as exc:
            raise HTTPError(400, exc.reason) from None
        r = Render(call, complete(reply, call), next(numbers), int(time.time()), payload)
        if model.latency_s > 0:
            await trio.sleep(model.latency_s)
        if not call.stream:
            return await send_json(send, 200, render(r))
        await stream_events(receive, send, stream(r))

    def error(scope: Scope, err: HTTPError) -> Json:
        protocol = PROTOCOLS.get(normalise(scope["path"]))
        return error_body(protocol[0] if protocol else "openai", err.status, err.reason)

    def keyed(handler: App) -> App:
        async def checked(scope: Scope, receive: Receive, send: Send) -> None:
            require_key(scope, admin_key)
            await handler(scope, receive, send)

        return checked

    router = Router(error_body=error)
    router.add("GET", "/v1/models", keyed(models))
    for path in PROTOCOLS:
        router.add("POST", path, keyed(generate))
    return router
