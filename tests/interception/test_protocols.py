"""Protocols on their own: what a turn records from answers and streams of each shape."""

from __future__ import annotations

import orjson
import pytest

from lowwater.http import HTTPError
from lowwater.interception import AnthropicMessages, OpenAIChat, OpenAIResponses
from lowwater.interception.sse import SSEParser

from .upstream import _Answer


def feed_all(protocol, events: list[bytes]):
    acc, parser, terminal = protocol.accumulator(), SSEParser(), []
    for event in parser.feed(b"".join(events)):
        terminal.append(acc.feed(event.event, event.data))
    return acc.result(), terminal


@pytest.mark.parametrize("tool", [False, True])
@pytest.mark.parametrize(
    "kind,protocol", [("chat", OpenAIChat()), ("responses", OpenAIResponses()), ("messages", AnthropicMessages())]
)
def test_stream_accumulates_to_what_the_whole_answer_says(kind, protocol, tool):
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "a b c"}],
        "input": "a b c",
        "logprobs": True,
        "return_token_ids": True,
        "include": ["message.output_text.logprobs"],
    }
    answer = _Answer(kind, request, tool)
    whole = protocol.completion(orjson.loads(orjson.dumps(answer.body())))
    streamed, terminal = feed_all(protocol, answer.events())
    assert terminal[-1] is True and not any(terminal[:-1])
    assert streamed.finish_reason == whole.finish_reason
    assert streamed.token_ids == whole.token_ids and streamed.logprobs == whole.logprobs
    if kind == "chat":
        assert streamed.completion["content"] == whole.completion["content"]
        assert streamed.completion.get("tool_calls") == whole.completion.get("tool_calls")
        assert whole.token_ids == [1000, 1001, 1002, 1003]
    else:
        assert streamed.completion == whole.completion
    assert streamed.usage == whole.usage


def test_token_ids_from_token_strings_and_text_tokens():
    chat = OpenAIChat()
    entries = [{"token": "token_id:5", "logprob": -1.0}, {"token": "token_id:9", "logprob": -2.0}]
    done = chat.completion({"choices": [{"message": {}, "logprobs": {"content": entries}}]})
    assert done.token_ids == [5, 9] and done.logprobs == [-1.0, -2.0]
    done = chat.completion({"choices": [{"message": {}, "logprobs": {"content": [{"token": "hi", "logprob": -1}]}}]})
    assert done.token_ids is None and done.logprobs == [-1.0]
    done = chat.completion({"choices": [{"message": {}, "token_ids": [1, 2]}]})
    assert done.token_ids == [1, 2] and done.logprobs is None


@pytest.mark.parametrize(
    "answer", [None, [], "x", {"choices": "x"}, {"choices": [None]}, {"choices": [{"logprobs": 3}]}]
)
def test_odd_answers_do_not_crash(answer):
    for protocol in (OpenAIChat(), OpenAIResponses(), AnthropicMessages()):
        protocol.completion(answer)


def test_upstream_errors_inside_streams_are_recorded():
    chat, _ = feed_all(OpenAIChat(), [b'data: {"error": {"message": "overloaded"}}\n\n'])
    assert chat.error == "overloaded"
    msgs, _ = feed_all(
        AnthropicMessages(), [b'event: error\ndata: {"type": "error", "error": {"message": "busy"}}\n\n']
    )
    assert msgs.error == "busy"
    failed = b'event: response.failed\ndata: {"type": "response.failed", "response": {"status": "failed", "error": {"message": "boom"}}}\n\n'
    resp, terminal = feed_all(OpenAIResponses(), [failed])
    assert terminal == [True] and resp.error == "boom" and resp.finish_reason == "failed"


def test_incomplete_response_reason():
    done = OpenAIResponses().completion({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}})
    assert done.finish_reason == "max_output_tokens" and done.error is None


def test_data_plane_rewrites_ask_for_logprobs_only_when_asked():
    chat, resp, msgs = OpenAIChat(), OpenAIResponses(), AnthropicMessages()
    for protocol in (chat, resp, msgs):
        assert protocol.data_plane_rewrites(logprobs=False) == {}
    assert chat.data_plane_rewrites(logprobs=True) == {"set": {"logprobs": "true", "return_token_ids": "true"}}
    assert resp.data_plane_rewrites(logprobs=True) == {"append": {"include": '"message.output_text.logprobs"'}}
    assert msgs.data_plane_rewrites(logprobs=True) == {}


def test_responses_string_input_is_one_user_message():
    request = OpenAIResponses().parse({"model": "m", "input": "hi", "stream": True})
    assert request.messages == [{"role": "user", "content": "hi"}] and request.stream


@pytest.mark.parametrize(
    "body,reason",
    [
        ({"model": "m", "input": 3}, "'input' must be a string or a non-empty list"),
        ({"model": "m", "input": []}, "'input' must be a string or a non-empty list"),
        ({"model": "m"}, "missing field 'input'"),
    ],
)
def test_responses_validation(body, reason):
    with pytest.raises(HTTPError) as info:
        OpenAIResponses().parse(body)
    assert info.value.status == 400 and reason in info.value.reason


def test_anthropic_system_must_be_text():
    with pytest.raises(HTTPError, match="'system'"):
        AnthropicMessages().parse(
            {"model": "m", "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "x"}]}
        )


def test_error_shapes():
    assert OpenAIChat().error_body(401, "no")["error"]["type"] == "authentication_error"
    assert AnthropicMessages().error_body(413, "big") == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "big"},
    }
    assert AnthropicMessages().error_event("cut").startswith(b"event: error\ndata: ")
    head, data, blank = OpenAIChat().error_event("cut").split(b"\n", 2)
    assert head == b"event: error" and blank == b"\n"
    assert orjson.loads(data.removeprefix(b"data: ")) == {
        "type": "error",
        "error": {"message": "cut", "type": "api_error", "code": None},
    }


# The error type each SDK's docs give for a status; anything unlisted is api_error.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 408, 409, 410, 413, 415, 429, 500, 502, 503, 504, 529])
def test_error_types_by_status(status):
    openai = OpenAIChat().error_body(status, "why")
    assert openai == {
        "error": {"message": "why", "type": _OPENAI_TYPES.get(status, "api_error"), "param": None, "code": status}
    }
    anthropic = AnthropicMessages().error_body(status, "why")
    assert anthropic == {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": "why"},
    }


def test_an_unknown_error_flavour_is_a_value_error():
    class Odd(OpenAIChat):
        error_flavour = "grpc"

    with pytest.raises(ValueError, match='unknown error flavour "grpc"'):
        Odd().error_body(400, "x")
    with pytest.raises(ValueError, match="unknown error flavour"):
        Odd().error_event("x")
