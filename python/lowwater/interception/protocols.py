"""Wire protocols of the interception server.

A :class:`Protocol` knows one endpoint's wire format.  It validates a
request (:class:`~lowwater.http.HTTPError` 400 with a reason), names the
messages a turn's delta is computed from and the tools the agent offered
(:meth:`Protocol.tools`; none by default), declares what the data plane splices into
the body sent upstream (:meth:`Protocol.data_plane_rewrites`: logprob capture), and turns an upstream answer,
whole or streamed, into what the turn records: completion, finish reason,
usage, token ids and logprobs.  It also knows its error shapes, so the
agent's SDK reads a proxy error the way it reads the real API's.

The built-in three (``openai.chat``, ``openai.responses``,
``anthropic.messages``) are registered as an ordinary plugin
(:mod:`lowwater.interception.plugin`); third parties add more through the
``register_protocols`` hook by subclassing :class:`Protocol`.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import orjson

from lowwater import _native
from lowwater.http import HTTPError

Json = dict[str, Any]


@attrs.frozen
class Request:
    """What the server needs of a validated request.

    Attributes:
        model: the model the agent asked for.
        stream: whether the agent asked for an SSE stream.
        messages: the messages (or input items) the turn's delta is taken
            from; references into the parsed body, not copies.
    """

    model: str
    stream: bool
    messages: list[Any]


@attrs.define
class Completion:
    """What a turn records of an answer (see :class:`lowwater.trajectory.Turn`).

    ``error`` is set when the upstream itself reported a failure inside an
    otherwise well-formed answer (an SSE ``error`` event, a failed response).
    """

    completion: Any = None
    finish_reason: str | None = None
    usage: Json | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    error: str | None = None


class StreamAccumulator:
    """Builds a turn from SSE events, one :meth:`feed` per event, in order."""

    def feed(self, event: str | None, data: str) -> bool:
        """Take one event; True if it is the protocol's terminal event.

        May raise any exception on a malformed event (the server records
        the turn as an error and breaks the agent's stream).
        """
        raise NotImplementedError

    def result(self) -> Completion:
        """The turn's fields from everything fed so far."""
        raise NotImplementedError


#: The JSON types :attr:`Wire.fields` may require of a top-level field.
FIELD_KINDS = ("string", "positive_integer", "string_or_array")


@attrs.frozen
class Wire:
    """What the Rust data plane (:class:`lowwater._native.DataPlane`) needs of a
    protocol to route, validate and relay its calls without Python: data,
    not code (docs/dataplane.md#what-rust-needs-from-a-protocol).

    Attributes:
        messages: the top-level key of the list a turn's delta is taken from
            (``"messages"``; ``"input"`` for the responses API).
        string_input: whether a plain string there stands for one user message.
        roles: the roles a message may have (empty: any JSON object).
        fields: ``(key, kind, required)`` per top-level field checked besides
            ``stream`` and the messages; ``kind`` one of :data:`FIELD_KINDS`.
        tools: the top-level keys holding the tools the agent offered,
            copied into each record for :meth:`Protocol.tools` to read.
        terminal_data: a stream ends with the event whose data, trimmed, is
            this text (``"[DONE]"``) ...
        terminal_types: ... or whose ``event:`` name (or JSON ``type``) is one
            of these (``("message_stop",)``).  Exactly one of the two is set.
        reads_any_json: the protocol's :meth:`Protocol.completion` and
            :meth:`Protocol.accumulator` never raise on JSON (any value, any
            shape; odd fields are left out of the turn), so the only answers
            the control plane fails are those that are not JSON, which the
            plane checks itself.  Then, in ``InterceptionServer``, a call
            whose answer is JSON gets its last bytes as soon as the plane has
            queued its record, without waiting for Python to read it (about
            0.2 ms less per call, benches/README.md).  Default ``False``: the
            answer waits until the turn is read, and a reader that raises
            fails the call (502), as for every protocol before.

    Raises:
        ValueError: an unknown field kind, or not exactly one terminal rule.
    """

    messages: str = "messages"
    string_input: bool = False
    roles: tuple[str, ...] = ()
    fields: tuple[tuple[str, str, bool], ...] = (("model", "string", True),)
    tools: tuple[str, ...] = ()
    terminal_data: str | None = None
    terminal_types: tuple[str, ...] = ()
    reads_any_json: bool = False

    def __attrs_post_init__(self) -> None:
        for key, kind, _ in self.fields:
            if kind not in FIELD_KINDS:
                raise ValueError(f"field {key!r}: kind {kind!r} is not one of {FIELD_KINDS}")
        if (self.terminal_data is None) == (not self.terminal_types):
            raise ValueError("give exactly one of terminal_data and terminal_types")


class Protocol:
    """Base class of a wire protocol: set ``name`` and ``path``, implement the methods.

    Attributes:
        name: unique protocol name (``"openai.chat"``); recorded on each turn
            and in the intercept table.
        path: the route (``"/v1/chat/completions"``); the upstream gets the
            same path under its own base URL.
        error_flavour: ``"openai"`` or ``"anthropic"``: the shape of error
            bodies and error events (:meth:`error_body`, :meth:`error_event`).
        wire: the protocol's :class:`Wire`, what the Rust data plane needs
            to serve it (``None``: the data plane cannot serve it).
    """

    name = ""
    path = ""
    error_flavour = "openai"
    wire: Wire | None = None

    def data_plane_spec(self) -> dict[str, Any]:
        """The protocol as :class:`lowwater._native.DataPlane`'s ``protocols``
        argument takes it (``name``, ``path``, ``flavour`` and the
        :class:`Wire`'s fields).

        Raises:
            ValueError: the protocol declares no :attr:`wire`.
        """
        if self.wire is None:
            raise ValueError(f"protocol {self.name!r} declares no wire format for the data plane")
        return {"name": self.name, "path": self.path, "flavour": self.error_flavour, **attrs.asdict(self.wire)}

    def parse(self, body: Any) -> Request:
        """Validate a decoded request body.

        Raises:
            HTTPError: 400 naming the missing or mistyped field.
        """
        raise NotImplementedError

    def tools(self, body: Json) -> list[Any] | None:
        """The tool definitions offered in a parsed request (the body :meth:`parse`
        accepted), as the request writes them; ``None`` when it offers none
        (the default: a protocol without tools).

        The turn records them (:attr:`lowwater.trajectory.Turn.tools`; a list
        equal to an earlier turn's is stored once).  Return references into
        ``body``, not copies, and never raise: whatever is not a list of
        tools is ``None`` (the upstream judges the request, not this).
        """
        return None

    def data_plane_rewrites(self, *, logprobs: bool) -> dict[str, dict[str, str]]:
        """What the data plane splices into every request of this protocol, as
        its ``rewrites`` argument takes one protocol's rules: ``{"set": {key:
        JSON text}, "append": {key: JSON text of an item}}`` (empty: nothing).

        ``logprobs`` asks the upstream for token ids and logprobs where the
        protocol has a way to (the base class has none).  The model override
        is per rollout (:meth:`DataPlane.register`), the sampling arguments
        per run; neither belongs here.
        """
        return {}

    def completion(self, answer: Any) -> Completion:
        """The turn's fields from a decoded non-streamed answer (tolerant of odd shapes)."""
        raise NotImplementedError

    def accumulator(self) -> StreamAccumulator:
        """A fresh accumulator for one streamed answer."""
        raise NotImplementedError

    def error_body(self, status: int, reason: str) -> Json:
        """The JSON error body for ``status`` in this protocol's shape
        (:attr:`error_flavour`): OpenAI's ``{"error": {"message", "type",
        "param", "code"}}`` or Anthropic's ``{"type": "error", "error":
        {"type", "message"}}``, with the error ``type`` each flavour's SDK
        maps ``status`` to.  The data plane's own table
        (:func:`lowwater._native.error_body`), so an error Python answers and
        one the plane answers are alike.

        Raises:
            ValueError: :attr:`error_flavour` is neither ``"openai"`` nor ``"anthropic"``.
            OverflowError: ``status`` is not in 0-65535.
        """
        return orjson.loads(_native.error_body(self.error_flavour, status, reason))

    def error_event(self, reason: str) -> bytes:
        """An SSE ``error`` event that makes the agent's SDK raise (sent
        before breaking a stream): the data plane's
        (:func:`lowwater._native.error_event`).

        Raises:
            ValueError: :attr:`error_flavour` is neither ``"openai"`` nor ``"anthropic"``.
        """
        return _native.error_event(self.error_flavour, reason)


# --- validation helpers --------------------------------------------------------


def _bad(reason: str) -> HTTPError:
    return HTTPError(400, reason)


def _object(body: Any) -> Json:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def _required(body: Json, key: str) -> Any:
    """``body[key]``; 400 ``missing field`` when it is absent or null."""
    value = body.get(key)
    if value is None:
        raise _bad(f"missing field {key!r}")
    return value


def _string(body: Json, key: str) -> str:
    value = _required(body, key)
    if not isinstance(value, str):
        raise _bad(f"field {key!r} must be a string")
    return value


def _stream_flag(body: Json) -> bool:
    stream = body.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise _bad("field 'stream' must be a boolean")
    return stream


def _messages(body: Json, roles: tuple[str, ...]) -> list[Any]:
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise _bad("field 'messages' must be a list of message objects")
    if not messages:
        raise _bad("field 'messages' must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object")
        if m.get("role") not in roles:
            raise _bad(f"messages[{i}].role must be one of {', '.join(roles)}")
    return messages


def _dict(value: Any) -> Json:
    return value if isinstance(value, dict) else {}


def _tool_list(value: Any) -> list[Any] | None:
    """``value`` if it is a non-empty list (the ``tools`` of a request), else ``None``."""
    return value if isinstance(value, list) and value else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: Any) -> str:
    """``value`` if it is a string, else ``""`` (an odd field adds nothing)."""
    return value if isinstance(value, str) else ""


def _index(value: Any) -> int:
    """A stream's block or tool-call index: an int (not a bool), else 0.

    An unhashable index (a list) raised in the accumulator, and an index of
    another type beside ints made the final ``sorted`` raise: either failed
    a call whose answer was JSON."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _logprob(value: Any) -> float:
    """A logprob as a float; NaN for what is not a number (``float("x")``
    raised and failed the call)."""
    if isinstance(value, (int, float, str)):
        try:
            return float(value)
        except (OverflowError, ValueError):  # an int past a double's range, a str not a number
            return math.nan
    return math.nan


def _ids_and_logprobs(entries: list[Any], ids: Any = None) -> tuple[list[int] | None, list[float] | None]:
    """Token ids and logprobs from OpenAI-format logprob entries.

    Ids come from the upstream's ``token_ids`` (vLLM's ``return_token_ids``)
    when present, else from tokens spelled ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``); text tokens give logprobs without ids.
    """
    entries = [e for e in entries if isinstance(e, dict)]
    logprobs = [_logprob(e.get("logprob", 0.0)) for e in entries] or None
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return list(ids), logprobs
    if not entries:
        return None, None
    parsed = []
    for e in entries:
        token = e.get("token")
        digits = token[9:] if isinstance(token, str) and token.startswith("token_id:") else ""
        # ASCII only and bounded: int() raised on "²" (a Unicode digit) and on
        # strings past Python's 4,300-digit limit.
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
            return None, logprobs
        parsed.append(int(digits))
    return parsed, logprobs


# --- OpenAI chat completions -----------------------------------------------------

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class OpenAIChat(Protocol):
    """OpenAI chat completions, ``POST /v1/chat/completions``; terminal event ``data: [DONE]``."""

    name = "openai.chat"
    path = "/v1/chat/completions"
    wire = Wire(roles=_CHAT_ROLES, tools=("tools", "functions"), terminal_data="[DONE]", reads_any_json=True)

    def parse(self, body: Any) -> Request:
        body = _object(body)
        return Request(_string(body, "model"), _stream_flag(body), _messages(body, _CHAT_ROLES))

    def tools(self, body: Json) -> list[Any] | None:
        """``tools``; failing that the deprecated ``functions``, each as the
        ``{"type": "function", "function": ...}`` entry ``tools`` would hold."""
        tools = _tool_list(body.get("tools"))
        if tools is None and (functions := _tool_list(body.get("functions"))) is not None:
            tools = [{"type": "function", "function": f} for f in functions]
        return tools

    def data_plane_rewrites(self, *, logprobs: bool) -> dict[str, dict[str, str]]:
        # vLLM and SGLang answer with completion token ids and their logprobs.
        return {"set": {"logprobs": "true", "return_token_ids": "true"}} if logprobs else {}

    def completion(self, answer: Any) -> Completion:
        answer = _dict(answer)
        choice = _dict((_list(answer.get("choices")) or [None])[0])
        ids, logprobs = _ids_and_logprobs(_list(_dict(choice.get("logprobs")).get("content")), choice.get("token_ids"))
        return Completion(choice.get("message"), choice.get("finish_reason"), answer.get("usage"), ids, logprobs)

    def accumulator(self) -> StreamAccumulator:
        return _ChatStream()


class _ChatStream(StreamAccumulator):
    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, Json] = {}
        self.out = Completion()
        self.entries: list[Any] = []
        self.ids: list[int] = []
        self.ids_seen = False

    def feed(self, event: str | None, data: str) -> bool:
        if data.strip() == "[DONE]":
            return True
        chunk = _dict(orjson.loads(data))
        if chunk.get("error"):
            error = chunk["error"]
            self.out.error = str(_dict(error).get("message") or error)
        if chunk.get("usage"):
            self.out.usage = chunk["usage"]
        for choice in _list(chunk.get("choices")):
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = _dict(choice.get("delta"))
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                self.reasoning.append(delta["reasoning_content"])
            for tc in _list(delta.get("tool_calls")):
                tc = _dict(tc)
                slot = self.tool_calls.setdefault(
                    _index(tc.get("index", 0)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = _dict(tc.get("function"))
                slot["function"]["name"] += _str(fn.get("name"))
                slot["function"]["arguments"] += _str(fn.get("arguments"))
            if choice.get("finish_reason"):
                self.out.finish_reason = choice["finish_reason"]
            self.entries += _list(_dict(choice.get("logprobs")).get("content"))
            if isinstance(choice.get("token_ids"), list):
                self.ids_seen = True
                self.ids += choice["token_ids"]
        return False

    def result(self) -> Completion:
        message: Json = {"role": "assistant", "content": "".join(self.content) if self.content else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        self.out.completion = message
        self.out.token_ids, self.out.logprobs = _ids_and_logprobs(self.entries, self.ids if self.ids_seen else None)
        return self.out


# --- OpenAI responses ------------------------------------------------------------

_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_LOGPROBS_INCLUDE = "message.output_text.logprobs"


class OpenAIResponses(Protocol):
    """OpenAI responses, ``POST /v1/responses``; terminal event ``response.completed``
    (or ``response.incomplete`` / ``response.failed``)."""

    name = "openai.responses"
    path = "/v1/responses"
    wire = Wire(
        messages="input",
        string_input=True,
        tools=("tools",),
        terminal_types=("response.completed", "response.incomplete", "response.failed"),
        reads_any_json=True,
    )

    def parse(self, body: Any) -> Request:
        body = _object(body)
        model = _string(body, "model")
        items = _required(body, "input")
        if isinstance(items, str):
            messages: list[Any] = [{"role": "user", "content": items}]
        elif isinstance(items, list) and items:
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise _bad(f"input[{i}] must be an object")
            messages = items
        else:
            raise _bad("field 'input' must be a string or a non-empty list of input items")
        return Request(model, _stream_flag(body), messages)

    def tools(self, body: Json) -> list[Any] | None:
        """``tools`` (function tools and built-in ones such as ``web_search``)."""
        return _tool_list(body.get("tools"))

    def data_plane_rewrites(self, *, logprobs: bool) -> dict[str, dict[str, str]]:
        return {"append": {"include": orjson.dumps(_LOGPROBS_INCLUDE).decode()}} if logprobs else {}

    def completion(self, answer: Any) -> Completion:
        answer = _dict(answer)
        entries: list[Any] = []
        for item in _list(answer.get("output")):
            for part in _list(_dict(item).get("content")):
                entries += _list(_dict(part).get("logprobs"))
        ids, logprobs = _ids_and_logprobs(entries)
        status = answer.get("status")
        reason = _dict(answer.get("incomplete_details")).get("reason") if status == "incomplete" else None
        error = None
        if status == "failed":
            error = str(_dict(answer.get("error")).get("message") or "the upstream response failed")
        return Completion(answer.get("output"), reason or status, answer.get("usage"), ids, logprobs, error)

    def accumulator(self) -> StreamAccumulator:
        return _ResponsesStream(self)


class _ResponsesStream(StreamAccumulator):
    def __init__(self, protocol: OpenAIResponses) -> None:
        self.protocol = protocol
        self.out = Completion()

    def feed(self, event: str | None, data: str) -> bool:
        obj = _dict(orjson.loads(data))
        kind = obj.get("type") or event
        # A list `type` is unhashable: `in` a frozenset raised on it.
        if isinstance(kind, str) and kind in _RESPONSES_TERMINAL:
            self.out = self.protocol.completion(obj.get("response"))
            return True
        if kind == "error":
            self.out.error = str(obj.get("message") or _dict(obj.get("error")).get("message") or "upstream error event")
        return False

    def result(self) -> Completion:
        return self.out


# --- Anthropic messages ------------------------------------------------------------


class AnthropicMessages(Protocol):
    """Anthropic messages, ``POST /v1/messages``; terminal event ``message_stop``."""

    name = "anthropic.messages"
    path = "/v1/messages"
    error_flavour = "anthropic"
    wire = Wire(
        roles=("user", "assistant"),
        fields=(
            ("model", "string", True),
            ("max_tokens", "positive_integer", True),
            ("system", "string_or_array", False),
        ),
        tools=("tools",),
        terminal_types=("message_stop",),
        reads_any_json=True,
    )

    def parse(self, body: Any) -> Request:
        body = _object(body)
        model = _string(body, "model")
        max_tokens = _required(body, "max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _bad("field 'max_tokens' must be a positive integer")
        system = body.get("system")
        if system is not None and not isinstance(system, (str, list)):
            raise _bad("field 'system' must be a string or a list of text blocks")
        return Request(model, _stream_flag(body), _messages(body, ("user", "assistant")))

    def tools(self, body: Json) -> list[Any] | None:
        """``tools`` (client tools with ``input_schema``, and server tools)."""
        return _tool_list(body.get("tools"))

    def completion(self, answer: Any) -> Completion:
        answer = _dict(answer)
        return Completion(answer.get("content"), answer.get("stop_reason"), answer.get("usage"))

    def accumulator(self) -> StreamAccumulator:
        return _MessagesStream()


class _MessagesStream(StreamAccumulator):
    def __init__(self) -> None:
        self.blocks: dict[int, Json] = {}
        self.json_parts: dict[int, list[str]] = {}
        self.out = Completion(usage={})

    def feed(self, event: str | None, data: str) -> bool:
        obj = _dict(orjson.loads(data))
        kind = obj.get("type") or event
        if kind == "message_start":
            self.out.usage = dict(_dict(_dict(obj.get("message")).get("usage")))
        elif kind == "content_block_start":
            self.blocks[_index(obj.get("index", 0))] = dict(_dict(obj.get("content_block")))
        elif kind == "content_block_delta":
            i, delta = _index(obj.get("index", 0)), _dict(obj.get("delta"))
            block = self.blocks.setdefault(i, {"type": "text", "text": ""})
            step = delta.get("type")
            if step == "text_delta":
                block["text"] = _str(block.get("text")) + _str(delta.get("text"))
            elif step == "thinking_delta":
                block["thinking"] = _str(block.get("thinking")) + _str(delta.get("thinking"))
            elif step == "signature_delta":
                block["signature"] = delta.get("signature")
            elif step == "input_json_delta":
                self.json_parts.setdefault(i, []).append(_str(delta.get("partial_json")))
        elif kind == "message_delta":
            self.out.finish_reason = _dict(obj.get("delta")).get("stop_reason")
            self.out.usage = {**(self.out.usage or {}), **_dict(obj.get("usage"))}
        elif kind == "error":
            self.out.error = str(_dict(obj.get("error")).get("message") or "upstream error event")
        elif kind == "message_stop":
            return True
        return False

    def result(self) -> Completion:
        for i, parts in self.json_parts.items():
            text = "".join(parts)
            try:
                self.blocks[i]["input"] = orjson.loads(text) if text else {}
            except orjson.JSONDecodeError:
                self.blocks[i]["input"] = text  # kept as sent: the trajectory shows what the model produced
        self.out.completion = [self.blocks[i] for i in sorted(self.blocks)]
        return self.out


def builtin_protocols() -> list[Protocol]:
    """Fresh instances of the three built-in protocols."""
    return [OpenAIChat(), OpenAIResponses(), AnthropicMessages()]
