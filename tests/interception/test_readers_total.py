"""The built-in protocols read any JSON answer without raising (``Wire.reads_any_json``).

The data plane releases a call whose answer is JSON before the control plane
has read it, for protocols that declare ``reads_any_json``: it checks the
JSON itself, so a reader that raised on some JSON shape would have failed a
call (502) the agent already holds.  These properties feed each built-in
protocol's ``completion`` and stream accumulator arbitrary JSON, shaped like
its answers and not."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowwater.interception.protocols import builtin_protocols

KEYS = st.sampled_from(
    [
        "choices",
        "message",
        "delta",
        "content",
        "tool_calls",
        "index",
        "function",
        "name",
        "arguments",
        "logprobs",
        "logprob",
        "token",
        "token_ids",
        "finish_reason",
        "usage",
        "error",
        "type",
        "output",
        "status",
        "incomplete_details",
        "reason",
        "response",
        "content_block",
        "text",
        "thinking",
        "partial_json",
        "signature",
        "stop_reason",
        "id",
        "x",
    ]  # fmt: skip
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "token_id:7",
            "token_id:²",
            "message_stop",
            "response.completed",
            "text_delta",
            "input_json_delta",
            "content_block_delta",
            "[DONE]",
        ]
    )  # fmt: skip
)
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5), max_leaves=30
)
EVENTS = st.sampled_from([None, "message_start", "content_block_start", "content_block_delta", "message_delta",
                          "message_stop", "error", "response.completed", "response.output_text.delta"])  # fmt: skip
PROTOCOLS = {p.name: p for p in builtin_protocols()}


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_each_builtin_declares_it(name):
    wire = PROTOCOLS[name].wire
    assert wire is not None and wire.reads_any_json


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
@settings(max_examples=300, deadline=None)
@given(answer=JSON)
def test_a_whole_answer_of_any_json_is_read(name, answer):
    # As the control plane reads it: orjson's round trip, then completion().
    PROTOCOLS[name].completion(orjson.loads(orjson.dumps(answer)))


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.tuples(EVENTS, JSON), max_size=8))
def test_a_stream_of_any_json_events_is_read(name, events):
    accumulator = PROTOCOLS[name].accumulator()
    for event, data in events:
        if accumulator.feed(event, orjson.dumps(data).decode()):
            break
    accumulator.result()
