"""``serve-model``'s rendering: a :class:`Completion` (a reply cut to the
token budget) written as each protocol's JSON body or SSE events, and each
protocol's error body.
"""

from __future__ import annotations

import base64
import itertools
import random
from collections.abc import Iterator
from typing import Any

import attrs
import orjson

from lowwater.serve_model import tokens
from lowwater.serve_model.replay import Reply, ToolCall
from lowwater.serve_model.requests import Call, Json


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


def _sse(data: Json | str, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


@attrs.define
class Render:
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


def chat_body(r: Render) -> Json:
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


def chat_events(r: Render) -> Iterator[bytes]:
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


def messages_body(r: Render) -> Json:
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


def messages_events(r: Render) -> Iterator[bytes]:
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


def _response(r: Render, output: list[Json], status: str) -> Json:
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


def _response_items(r: Render) -> list[Json]:
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


def responses_body(r: Render) -> Json:
    return r.with_payload(_response(r, _response_items(r), _final_status(r.done)))


def responses_events(r: Render) -> Iterator[bytes]:
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
