"""SSE parsing: framing per the WHATWG spec, whatever the chunking."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from lowwater.interception.sse import Event, SSEParser, encode


def test_fields_comments_and_multiline_data():
    parser = SSEParser()
    events = parser.feed(b": keep-alive\n\nevent: a\ndata: one\ndata:two\nid: 7\n\ndata: [DONE]\n\n")
    assert events == [
        Event(b"event: a\ndata: one\ndata:two\nid: 7\n\n", "a", "one\ntwo"),
        Event(b"data: [DONE]\n\n", None, "[DONE]"),
    ]
    assert parser.pending == b""


def test_line_endings_are_normalised_across_chunks():
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []  # "\r" then "\n" in the next chunk is one line end
    assert parser.feed(b"\n\r") == []
    assert parser.feed(b"\ndata: y\r\rdata: z") == [Event(b"data: x\n\n", None, "x"), Event(b"data: y\n\n", None, "y")]
    assert parser.feed(b"\n\n") == [Event(b"data: z\n\n", None, "z")]
    assert parser.pending == b""


def test_a_cut_stream_leaves_pending_bytes():
    parser = SSEParser()
    parser.feed(b'data: {"a": 1}\n\ndata: {"b"')
    assert parser.pending == b'data: {"b"'


def test_encode():
    assert encode({"a": 1}, "x") == b'event: x\ndata: {"a":1}\n\n'
    assert encode("[DONE]") == b"data: [DONE]\n\n"


_text = st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20)
_events = st.lists(
    st.tuples(
        st.one_of(st.none(), _text.filter(lambda s: s.strip() == s and s)), st.lists(_text, min_size=1, max_size=3)
    ),
    min_size=1,
    max_size=8,
)


@given(_events, st.lists(st.integers(1, 40), max_size=30), st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_any_chunking_gives_the_same_events(events, cuts, newline):
    wire = b""
    for name, data in events:
        lines = ([f"event: {name}"] if name else []) + [f"data: {d}" for d in data]
        wire += b"".join(line.encode() + newline for line in lines) + newline
    one = SSEParser()
    whole = one.feed(wire) + one.finish()
    parser, got, pos = SSEParser(), [], 0
    for cut in cuts:
        got += parser.feed(wire[pos : pos + cut])
        pos += cut
    got += parser.feed(wire[pos:])
    got += parser.finish()
    assert got == whole
    assert [(e.event, e.data) for e in got] == [(name, "\n".join(data)) for name, data in events]
    assert parser.pending == b""
