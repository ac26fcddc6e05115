"""``serve-model``'s request parsing: each protocol's body reduced to a
:class:`Call` (the question, tool results after it, whether a calculator is
offered, the token-capture options), or a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from lowwater.http import HTTPError
from lowwater.serve_model.replay import TOOL_NAME

Json = dict[str, Any]


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
