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

import base64
import itertools
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import attrs
import orjson
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
from lowwater.serve_model import tokens
from lowwater.serve_model.replay import TOOL_NAME, ModelError, Reply, ToolCall

MAX_BODY_BYTES = 64 << 20

Json = dict[str, Any]


class Model(Protocol):
    """What the app needs of a model (both built-in models satisfy it)."""

    name: str
    latency_s: float
    payload_bytes: int

    def reply(self, question: str, tool_results: int, *, tools: bool = True) -> Reply: ...


@attrs.frozen
class Call:
    """A request reduced to what the model and the renderer need.

    Attributes:
        model: the requested model name, echoed back.
        question: text of the last user message that is not a tool result.
        tool_results: tool results after that message.
        tools: a ``calculator`` tool is offered and tool use is not switched off.
        stream: answer as SSE.
        max_tokens: completion budget, or ``None``.
        logprobs, top_logprobs, token_id_strings, return_token_ids: token
            capture options (see the module docstring).
        include_usage: chat ``stream_options.include_usage``.
        prompt: the request's text fields (references, not copies).
    """

    model: str
    question: str
    tool_results: int
    tools: bool
    stream: bool
    max_tokens: int | None
    prompt: list[str]
    logprobs: bool = False
    top_logprobs: int = 0
    token_id_strings: bool = False
    return_token_ids: bool = False
    include_usage: bool = False


@attrs.frozen
class Completion:
    """A reply cut to the token budget.

    Attributes:
        finish: ``"stop"``, ``"tool"`` (ends with a tool call) or ``"length"``
            (the budget ran out; the tool call, if any, is dropped).
    """

    text: str
    pieces: list[str]
    tool_call: ToolCall | None
    finish: str
    prompt_tokens: int
    completion_tokens: int


def complete(reply: Reply, call: Call) -> Completion:
    """Fit ``reply`` into ``call.max_tokens`` and count its tokens."""
    pieces = tokens.split(reply.text)
    tool_call = reply.tool_call
    arg_tokens = tokens.count(tool_call.arguments) if tool_call else 0
    finish = "tool" if tool_call else "stop"
    if call.max_tokens is not None and len(pieces) + arg_tokens > call.max_tokens:
        pieces, tool_call, arg_tokens, finish = pieces[: call.max_tokens], None, 0, "length"
    prompt_tokens = tokens.prompt_count(sum(map(len, call.prompt)))
    return Completion("".join(pieces), pieces, tool_call, finish, prompt_tokens, len(pieces) + arg_tokens)


# --- request parsing ---------------------------------------------------------

_TEXT_PARTS = {"text", "input_text", "output_text"}
# Keys whose string values are text the model reads (counted as prompt tokens).
_TEXT_KEYS = {"content", "text", "output", "arguments", "instructions", "system", "input"}


def _bad(reason: str) -> HTTPError:
    return HTTPError(400, reason)


_KIND_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "an array", dict: "an object"}


def _get(body: Json, key: str, kinds: type | tuple[type, ...], *, required: bool = False) -> Any:
    """``body[key]`` if it has one of ``kinds``; ``None`` if absent or null; :class:`HTTPError` 400 otherwise."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    value = body.get(key)
    if value is None:
        if required:
            raise _bad(f"missing field {key}")
        return None
    # bool is an int subclass, but a flag is never a count.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _bad(f"field {key} must be " + " or ".join(_KIND_NAMES[k] for k in kinds))
    return value


def _positive(body: Json, key: str, *, required: bool = False) -> int | None:
    value = _get(body, key, int, required=required)
    if value is not None and value < 1:
        raise _bad(f"field {key} must be >= 1")
    return value


def _request(body: Any) -> tuple[Json, str]:
    """The body as a JSON object and its ``model``; :class:`HTTPError` 400 otherwise."""
    if not isinstance(body, dict):
        raise _bad("body must be a JSON object")
    return body, _get(body, "model", str, required=True)


def _messages(body: Json) -> list[Any]:
    """``body["messages"]``, required and non-empty (its items are checked by :func:`_objects`)."""
    messages: list[Any] = _get(body, "messages", list, required=True)
    if not messages:
        raise _bad("field messages must not be empty")
    return messages


def _objects(items: list[Any], where: str) -> Iterator[tuple[int, Json]]:
    """``(i, item)`` of a list of objects, each checked as it is reached
    (``where[i] must be an object`` otherwise)."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"{where}[{i}] must be an object")
        yield i, item


def _top_logprobs(body: Json) -> int:
    top = _get(body, "top_logprobs", int) or 0
    if not 0 <= top <= 20:
        raise _bad("field top_logprobs must be between 0 and 20")
    return top


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string, or the text parts of a list of parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{where}[{j}] must be an object with a string type")
        if part["type"] in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"{where}[{j}].text must be a string")
            texts.append(text)
    # A blank line between parts keeps "instruction part, question part" apart
    # for the after-the-last-blank-line lookup.
    return "\n\n".join(texts)


def _collect_text(value: Any, out: list[str], key: str | None = None) -> None:
    if isinstance(value, str):
        if key in _TEXT_KEYS:
            out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _collect_text(v, out, k)
    elif isinstance(value, list):
        for v in value:
            _collect_text(v, out, key)


def _offers_calculator(body: Json) -> bool:
    tools = _get(body, "tools", list)
    choice = body.get("tool_choice")
    if not tools or choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
        return False
    for _, tool in _objects(tools, "tools"):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else tool.get("name")
        if name == TOOL_NAME:
            return True
    return False


def _no_question() -> HTTPError:
    return _bad("no user message with text")


def parse_chat(body: Any) -> Call:
    """A ``/v1/chat/completions`` body; :class:`HTTPError` 400 naming the bad field."""
    body, model = _request(body)
    messages = _messages(body)
    question, results = None, 0
    for i, message in _objects(messages, "messages"):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise _bad(f"messages[{i}].role must be system, developer, user, assistant or tool")
        text = _text(message.get("content"), f"messages[{i}].content")
        if role == "user" and text.strip():
            question, results = text, 0
        elif role in ("tool", "function"):
            results += 1
    if question is None:
        raise _no_question()
    top = _top_logprobs(body)
    options = _get(body, "stream_options", dict) or {}
    prompt: list[str] = []
    _collect_text(messages, prompt, "content")
    return Call(
        model,
        question,
        results,
        _offers_calculator(body),
        bool(_get(body, "stream", bool)),
        _positive(body, "max_completion_tokens") or _positive(body, "max_tokens"),
        prompt,
        logprobs=bool(_get(body, "logprobs", bool)),
        top_logprobs=top,
        token_id_strings=bool(_get(body, "return_tokens_as_token_ids", bool)),
        return_token_ids=bool(_get(body, "return_token_ids", bool)),
        include_usage=bool(options.get("include_usage")),
    )


def parse_responses(body: Any) -> Call:
    """A ``/v1/responses`` body; :class:`HTTPError` 400 naming the bad field."""
    body, model = _request(body)
    items = _get(body, "input", (str, list), required=True)
    _get(body, "instructions", str)
    question, results = None, 0
    if isinstance(items, str):
        question = items if items.strip() else None
    for i, item in _objects(items if isinstance(items, list) else [], "input"):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"input[{i}].role must be user, assistant, system or developer")
            text = _text(item.get("content"), f"input[{i}].content")
            if role == "user" and text.strip():
                question, results = text, 0
        elif kind == "function_call_output":
            results += 1
    if question is None:
        raise _no_question()
    include = _get(body, "include", list) or []
    top = _top_logprobs(body)
    prompt: list[str] = []
    _collect_text({"input": items, "instructions": body.get("instructions")}, prompt)
    return Call(
        model,
        question,
        results,
        _offers_calculator(body),
        bool(_get(body, "stream", bool)),
        _positive(body, "max_output_tokens"),
        prompt,
        logprobs="message.output_text.logprobs" in include,
        top_logprobs=top,
    )


def parse_messages(body: Any) -> Call:
    """A ``/v1/messages`` body (``max_tokens`` is required, as upstream); :class:`HTTPError` 400."""
    body, model = _request(body)
    max_tokens = _positive(body, "max_tokens", required=True)
    messages = _messages(body)
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise _bad("field system must be a string or an array of text blocks")
    question, results = None, 0
    for i, message in _objects(messages, "messages"):
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role must be user or assistant")
        content = message.get("content")
        text = _text(content, f"messages[{i}].content")
        tool_results = sum(1 for b in content if b.get("type") == "tool_result") if isinstance(content, list) else 0
        # A user turn carrying tool results answers calls; it is not a new question
        # even if it adds text beside them (some agents do).
        if role == "user" and tool_results:
            results += tool_results
        elif role == "user" and text.strip():
            question, results = text, 0
    if question is None:
        raise _no_question()
    prompt: list[str] = []
    _collect_text({"content": messages, "system": system}, prompt)
    return Call(
        model, question, results, _offers_calculator(body), bool(_get(body, "stream", bool)), max_tokens, prompt
    )


# --- rendering ---------------------------------------------------------------


def _sse(data: Json | str, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


@attrs.define
class _Render:
    """Per-response context shared by the renderers."""

    call: Call
    done: Completion
    number: int
    created: int
    payload: str | None

    def logprob_entries(self) -> list[Json]:
        return [tokens.logprob_entry(p, self.call.top_logprobs, self.call.token_id_strings) for p in self.done.pieces]

    def completion_ids(self) -> list[int]:
        ids = [tokens.token_id(p) for p in self.done.pieces]
        return ids + (tokens.ids(self.done.tool_call.arguments) if self.done.tool_call else [])

    def with_payload(self, obj: Json) -> Json:
        if self.payload is not None:
            obj["x_lowwater_payload"] = self.payload
        return obj


# Chat completions.

_CHAT_FINISH = {"stop": "stop", "tool": "tool_calls", "length": "length"}


def _chat_usage(done: Completion) -> Json:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def chat_body(r: _Render) -> Json:
    done, call = r.done, r.call
    message: Json = {
        "role": "assistant",
        "content": done.text if done.text or not done.tool_call else None,
        "refusal": None,
    }
    if done.tool_call:
        tc = done.tool_call
        message["tool_calls"] = [
            {"id": f"call_{tc.id}", "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
        ]
    choice: Json = {
        "index": 0,
        "message": message,
        "logprobs": {"content": r.logprob_entries()} if call.logprobs else None,
        "finish_reason": _CHAT_FINISH[done.finish],
    }
    body: Json = {
        "id": f"chatcmpl-lw{r.number:012d}",
        "object": "chat.completion",
        "created": r.created,
        "model": call.model,
        "choices": [choice],
        "usage": _chat_usage(done),
        "system_fingerprint": None,
    }
    if call.return_token_ids:
        choice["token_ids"] = r.completion_ids()
        body["prompt_token_ids"] = tokens.ids("".join(call.prompt))
    return r.with_payload(body)


def chat_events(r: _Render) -> Iterator[bytes]:
    done, call = r.done, r.call
    base: Json = {
        "id": f"chatcmpl-lw{r.number:012d}",
        "object": "chat.completion.chunk",
        "created": r.created,
        "model": call.model,
        "system_fingerprint": None,
    }

    def chunk(
        delta: Json, finish: str | None = None, logprobs: Json | None = None, ids: list[int] | None = None
    ) -> Json:
        choice: Json = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if ids is not None and call.return_token_ids:
            choice["token_ids"] = ids
        return {**base, "choices": [choice]}

    first = chunk({"role": "assistant", "content": ""})
    if call.return_token_ids:
        first["prompt_token_ids"] = tokens.ids("".join(call.prompt))
    yield _sse(first)
    for piece in done.pieces:
        logprobs = (
            {"content": [tokens.logprob_entry(piece, call.top_logprobs, call.token_id_strings)]}
            if call.logprobs
            else None
        )
        yield _sse(chunk({"content": piece}, logprobs=logprobs, ids=[tokens.token_id(piece)]))
    if done.tool_call:
        tc = done.tool_call
        yield _sse(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": f"call_{tc.id}",
                            "type": "function",
                            "function": {"name": tc.name, "arguments": ""},
                        }
                    ]
                }
            )
        )
        yield _sse(
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": tc.arguments}}]}, ids=tokens.ids(tc.arguments))
        )
    yield _sse(r.with_payload(chunk({}, _CHAT_FINISH[done.finish])))
    if call.include_usage:
        yield _sse({**base, "choices": [], "usage": _chat_usage(done)})
    yield _sse("[DONE]")


# Anthropic messages.

_STOP_REASON = {"stop": "end_turn", "tool": "tool_use", "length": "max_tokens"}


def _anthropic_blocks(done: Completion) -> list[Json]:
    blocks: list[Json] = []
    if done.text or not done.tool_call:
        blocks.append({"type": "text", "text": done.text})
    if done.tool_call:
        tc = done.tool_call
        blocks.append(
            {"type": "tool_use", "id": f"toolu_{tc.id}", "name": tc.name, "input": {"expression": tc.expression}}
        )
    return blocks


def messages_body(r: _Render) -> Json:
    done = r.done
    return r.with_payload(
        {
            "id": f"msg_lw{r.number:012d}",
            "type": "message",
            "role": "assistant",
            "model": r.call.model,
            "content": _anthropic_blocks(done),
            "stop_reason": _STOP_REASON[done.finish],
            "stop_sequence": None,
            "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens},
        }
    )


def messages_events(r: _Render) -> Iterator[bytes]:
    done = r.done
    start: dict[str, Any] = {
        "id": f"msg_lw{r.number:012d}",
        "type": "message",
        "role": "assistant",
        "model": r.call.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": done.prompt_tokens, "output_tokens": 1},
    }
    yield _sse({"type": "message_start", "message": start}, "message_start")
    yield _sse({"type": "ping"}, "ping")
    for index, block in enumerate(_anthropic_blocks(done)):
        if block["type"] == "text":
            opening: Json = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in done.pieces]
        else:
            opening = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}]
        yield _sse({"type": "content_block_start", "index": index, "content_block": opening}, "content_block_start")
        for delta in deltas:
            yield _sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        yield _sse({"type": "content_block_stop", "index": index}, "content_block_stop")
    final = {
        "type": "message_delta",
        "delta": {"stop_reason": _STOP_REASON[done.finish], "stop_sequence": None},
        "usage": {"output_tokens": done.completion_tokens},
    }
    yield _sse(r.with_payload(final), "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")


# OpenAI responses.


def _response(r: _Render, output: list[Json], status: str) -> Json:
    done = r.done
    return {
        "id": f"resp_lw{r.number:012d}",
        "object": "response",
        "created_at": r.created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "max_output_tokens": r.call.max_tokens,
        "model": r.call.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "usage": None
        if status == "in_progress"
        else {
            "input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        },
    }


def _response_items(r: _Render) -> list[Json]:
    """The finished output items: a message unless the turn is only a tool call, then the call."""
    done, items = r.done, []
    if done.text or not done.tool_call:
        part = {
            "type": "output_text",
            "text": done.text,
            "annotations": [],
            "logprobs": r.logprob_entries() if r.call.logprobs else [],
        }
        items.append(
            {
                "type": "message",
                "id": f"msg_lw{r.number:012d}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    if done.tool_call:
        tc = done.tool_call
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{tc.id}",
                "call_id": f"call_{tc.id}",
                "name": tc.name,
                "arguments": tc.arguments,
                "status": "completed",
            }
        )
    return items


def _final_status(done: Completion) -> str:
    return "incomplete" if done.finish == "length" else "completed"


def responses_body(r: _Render) -> Json:
    return r.with_payload(_response(r, _response_items(r), _final_status(r.done)))


def responses_events(r: _Render) -> Iterator[bytes]:
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    snapshot = _response(r, [], "in_progress")
    yield event("response.created", response=snapshot)
    yield event("response.in_progress", response=snapshot)
    items = _response_items(r)
    for index, item in enumerate(items):
        if item["type"] == "message":
            part = item["content"][0]
            yield event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            )
            empty = {**part, "text": "", "logprobs": []}
            yield event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=empty
            )
            for j, piece in enumerate(r.done.pieces):
                yield event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    delta=piece,
                    logprobs=part["logprobs"][j : j + 1],
                )
            yield event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
            yield event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        else:
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            yield event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=index, item=item)
    status = _final_status(r.done)
    yield event(f"response.{status}", response=r.with_payload(_response(r, items, status)))


# --- the app -----------------------------------------------------------------

_Parser = Callable[[Any], Call]
_Renderer = Callable[[_Render], Json]
_Streamer = Callable[[_Render], Iterator[bytes]]

PROTOCOLS: dict[str, tuple[str, _Parser, _Renderer, _Streamer]] = {
    "/v1/chat/completions": ("openai", parse_chat, chat_body, chat_events),
    "/v1/responses": ("openai", parse_responses, responses_body, responses_events),
    "/v1/messages": ("anthropic", parse_messages, messages_body, messages_events),
}


def error_body(flavour: str, status: int, reason: str) -> Json:
    """An error in the shape the protocol's SDK reads (OpenAI or Anthropic)."""
    if flavour == "anthropic":
        kind = {404: "not_found_error", 413: "request_too_large"}.get(status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": reason}}
    return {"error": {"message": reason, "type": "invalid_request_error", "param": None, "code": None}}


def payload_text(size: int) -> str | None:
    """A deterministic base64 string of ``size`` bytes (``None`` for 0): an image-sized field."""
    if size <= 0:
        return None
    raw = random.Random(size).randbytes(size * 3 // 4 + 3)
    return base64.b64encode(raw).decode()[:size]


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
        r = _Render(call, complete(reply, call), next(numbers), int(time.time()), payload)
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
