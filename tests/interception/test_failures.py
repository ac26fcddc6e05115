"""Failures: unregister mid-call, client disconnects, truncated bodies, and every upstream failure.

After each: the agent got an answer (never a 5xx of the proxy's own making:
only 502/504 for upstream failures), the intercept table is empty and no
handler is left waiting.
"""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient

from ._harness import KINDS, PATHS, body, run

TERMINAL = {"chat": b"data: [DONE]", "responses": b"event: response.completed", "messages": b"event: message_stop"}


async def until(predicate) -> None:
    """Let the tasks run until ``predicate()`` holds (the harness deadline guards it)."""
    while not predicate():
        await trio.testing.wait_all_tasks_blocked()
        if not predicate():
            await trio.sleep(0.005)


async def stream_call(h, slot, kind, request, *, until_bytes: int = 0, then=None):
    """Open a streamed call, read ``until_bytes``, run ``then()``, read the rest.

    Returns ``(status, received bytes, the error that ended the read or None)``.
    """
    url = slot.base_url + PATHS[kind].removeprefix("/v1")
    received = b""
    async with h.http.stream("POST", url, json=request, headers={"authorization": f"Bearer {slot.secret}"}) as r:
        try:
            async for chunk in r.aiter_raw():
                received += chunk
                if then is not None and len(received) >= until_bytes:
                    then()
                    then = None
        except httpx.HTTPError as exc:
            return r.status_code, received, exc
        return r.status_code, received, None


async def broken_stream(h, slot, kind, **kw) -> bytes:
    """A streamed call (``kw`` as for :func:`stream_call`) whose answer starts
    (200) but does not end cleanly: the agent sees a broken stream, not a
    clean end it could mistake for a complete answer.  Returns the bytes read."""
    status, received, error = await stream_call(h, slot, kind, body(kind, stream=True), **kw)
    assert status == 200
    assert isinstance(error, httpx.RemoteProtocolError)  # the body never ends cleanly
    return received


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_unregister_before_the_upstream_answers_resolves_the_handler_at_once(kind, stream):
    async def fn(h):
        h.upstream.hang = True  # the upstream never answers: only unregister can end the call
        slot, trajectory = h.open("r")
        result = {}

        async def agent():
            result["r"] = await h.call(slot, kind, body(kind, stream=stream))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent)
            await h.upstream.entered.wait()
            assert h.server.stats()["waiting_handlers"] == 1 and len(h.server.table) == 1
            assert h.server.unregister("r") == 1  # the waiting call is cancelled
            assert len(h.server.table) == 0
        r = result["r"]
        assert r.status_code == 410
        message = r.json()["error"]["message"]
        assert "rollout r was closed" in message
        if kind == "messages":
            assert r.json()["type"] == "error"
        # Cancelling the handler closed the upstream request too.
        await until(lambda: h.upstream.disconnects == 1)
        assert trajectory.turns == []
        await h.assert_clean()
        stats = h.server.stats()
        # The body went with the call: swept by the close, or discarded by the
        # cancelled call itself, whichever ran first (they race on the plane's threads).
        table = stats["intercepts"]
        assert (table["entries"], table["swept"] + table["discards"], stats["calls"]["closed"]) == (0, 1, 1)

    run(fn)


@pytest.mark.parametrize("kind", KINDS)
def test_unregister_mid_stream_breaks_the_stream_at_once(kind):
    async def fn(h):
        h.upstream.hang_after = 3  # a few events, then silence
        slot, trajectory = h.open("r")
        received = await broken_stream(h, slot, kind, until_bytes=1, then=lambda: h.server.unregister("r"))
        assert b"rollout r was closed during the call" in received
        assert TERMINAL[kind] not in received
        await until(lambda: h.upstream.disconnects == 1)
        assert trajectory.turns == []
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("kind", KINDS)
def test_cut_upstream_stream_is_an_error_turn_and_a_broken_stream(kind):
    async def fn(h):
        h.upstream.cut_after = 3
        slot, trajectory = h.open()
        received = await broken_stream(h, slot, kind)
        assert TERMINAL[kind] not in received and b"upstream stream cut" in received
        (turn,) = trajectory.turns
        assert turn.error.startswith("upstream stream cut") and turn.streamed
        assert turn.request_delta == [{"role": "user", "content": "what is 2 plus 2"}]
        await h.assert_clean()
        assert h.server.stats()["calls"]["failed"] == 1

    run(fn)


@pytest.mark.parametrize("kind", KINDS)
def test_stream_without_terminal_event_is_an_error(kind):
    async def fn(h):
        slot, trajectory = h.open()
        h.upstream.cut_after = None
        # An upstream that ends its body cleanly but early: the terminal event never came.
        events = {"chat": 4, "responses": 5, "messages": 5}[kind]

        original = h.upstream._stream

        async def short(receive, send, all_events):
            await original(receive, send, all_events[:events])

        h.upstream._stream = short
        status, received, error = await stream_call(h, slot, kind, body(kind, stream=True))
        assert status == 200 and error is not None
        assert trajectory.turns[0].error == "upstream stream ended before its terminal event"
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_upstream_500_after_retries_is_502(kind, stream):
    async def fn(h):
        h.upstream.statuses.extend([500, 503, 502])
        slot, trajectory = h.open()
        r = await h.call(slot, kind, body(kind, stream=stream))
        assert r.status_code == 502 and "upstream answered 502" in r.json()["error"]["message"]
        assert h.server.stats()["plane"]["upstream_retried"] == 2
        assert trajectory.turns[0].error == "upstream answered 502"
        # Retries are invisible when one succeeds.
        h.upstream.statuses.extend([500, 429])
        r = await h.call(slot, kind, body(kind, stream=stream))
        assert r.status_code == 200 and h.server.stats()["plane"]["upstream_retried"] == 4
        assert trajectory.turns[1].error is None
        await h.assert_clean()

    run(fn, client={"retries": 2})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_upstream_429_passes_through_with_retry_after(kind, stream):
    async def fn(h):
        h.upstream.statuses.append(429)
        slot, trajectory = h.open()
        r = await h.call(slot, kind, body(kind, stream=stream))
        assert r.status_code == 429 and r.headers["retry-after"] == "0"
        assert r.json()["error"]["message"] == "scripted 429"
        assert trajectory.turns[0].error == "upstream answered 429"
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_upstream_timeout_is_504(kind, stream):
    async def fn(h):
        h.upstream.hang = True
        slot, trajectory = h.open()
        r = await h.call(slot, kind, body(kind, stream=stream))
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        assert trajectory.turns[0].error == "upstream timed out"
        await until(lambda: h.upstream.disconnects == 1)
        await h.assert_clean()

    run(fn, client={"timeout_s": 0.2})


@pytest.mark.parametrize("kind", KINDS)
def test_upstream_silent_mid_stream_times_out_into_a_broken_stream(kind):
    async def fn(h):
        h.upstream.hang_after = 3
        slot, trajectory = h.open()
        received = await broken_stream(h, slot, kind)
        assert b"upstream stream timed out" in received
        assert trajectory.turns[0].error.startswith("upstream stream timed out")
        await h.assert_clean()

    run(fn, client={"timeout_s": 0.2})


def test_upstream_unreachable_is_502():
    async def fn(h):
        slot, trajectory = h.open()
        # The discard port: connection refused.
        slot = h.server.register(Trajectory("r1"), upstream=ModelClient("http://127.0.0.1:9/v1", retries=1))
        trajectory = slot.trajectory
        for stream in (False, True):
            r = await h.call(slot, "chat", body("chat", stream=stream))
            assert r.status_code == 502 and "upstream unreachable" in r.json()["error"]["message"]
        assert h.server.stats()["plane"]["upstream_retried"] == 2
        assert [t.error.split(":")[0] for t in trajectory.turns] == ["upstream unreachable", "upstream unreachable"]
        await h.assert_clean()

    run(fn, client={"retries": 1})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_malformed_upstream_answer_is_502_or_a_broken_stream(kind, stream):
    async def fn(h):
        h.upstream.malformed = True
        slot, trajectory = h.open()
        if stream:
            await broken_stream(h, slot, kind)
            assert trajectory.turns[0].error.startswith("upstream sent a malformed event")
        else:
            r = await h.call(slot, kind, body(kind))
            assert r.status_code == 502
            assert trajectory.turns[0].error.startswith("upstream answer malformed")
        await h.assert_clean()

    run(fn)


@pytest.mark.parametrize("kind", KINDS)
def test_client_disconnect_mid_stream_cancels_the_upstream(kind):
    async def fn(h):
        h.upstream.hang_after = 3
        slot, trajectory = h.open()
        url = slot.base_url + PATHS[kind].removeprefix("/v1")
        async with h.http.stream(
            "POST", url, json=body(kind, stream=True), headers={"authorization": f"Bearer {slot.secret}"}
        ) as r:
            async for _ in r.aiter_raw():
                break  # the agent gives up after the first bytes
        await until(lambda: h.upstream.disconnects == 1)
        await h.assert_clean()
        (turn,) = trajectory.turns
        assert turn.error == "the client disconnected before the answer was complete"
        assert h.server.stats()["calls"]["disconnected"] == 1

    run(fn)


@pytest.mark.parametrize("kind", KINDS)
def test_client_disconnect_while_waiting_cancels_the_upstream(kind):
    async def fn(h):
        h.upstream.hang = True
        slot, trajectory = h.open()
        with trio.move_on_after(0.2):  # the agent's own timeout
            await h.call(slot, kind, body(kind))
        await until(lambda: h.upstream.disconnects == 1)
        await h.assert_clean()
        assert trajectory.turns[0].error == "the client disconnected before the answer was complete"

    run(fn)


def test_truncated_body_leaves_nothing_behind():
    async def fn(h):
        slot, trajectory = h.open()
        host, port = h.server.url.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + slot.secret.encode() + b'\r\ncontent-length: 1000\r\n\r\n{"model": "m"'
        )
        await trio.testing.wait_all_tasks_blocked()
        await stream.aclose()
        await h.assert_clean()
        assert trajectory.turns == [] and h.upstream.received == [] and h.server.table.stats()["inserts"] == 0

    run(fn)


async def _raw_reply(h, request: bytes) -> bytes:
    """Send ``request`` on a connection of its own; everything read until the server closes it."""
    host, port = h.server.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        await stream.send_all(request)
        reply = b""
        while chunk := await stream.receive_some():
            reply += chunk
        return reply
    finally:
        await stream.aclose()


@pytest.mark.parametrize(
    ("request_head", "status_line"),
    [
        (b"NOT HTTP AT ALL\r\n", b"HTTP/1.1 400"),
        # More headers than the HTTP parser's 100.
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(120)),
            b"HTTP/1.1 431 ",
        ),
        (b"GET /v1/" + b"a" * 70_000 + b" HTTP/1.1\r\nhost: x\r\n", b"HTTP/1.1 414 "),
        (b"POST /v1/chat/completions HTTP/1.1\r\nbad header\r\n", b"HTTP/1.1 400 "),
        (b"POST /v1/chat/completions HTTP/9.9\r\nhost: x\r\n", b"HTTP/1.1 400 "),
        # An HTTP/2 client with prior knowledge (the whole 24-byte preface, with the
        # blank line the test adds): no answer, the connection closed.
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n", b""),
    ],
    ids=["not-http", "too-many-headers", "uri-too-long", "bad-header", "bad-version", "http2-preface"],
)
def test_unparsable_http_is_refused_and_the_server_serves_on(request_head, status_line):
    """docs/interception.md#status-codes: HTTP the parser refuses is answered (or
    closed) before any rollout is touched, and the next call is served."""

    async def fn(h):
        reply = await _raw_reply(h, request_head + b"\r\n")
        if status_line:
            assert reply.startswith(status_line), reply[:80]
        else:
            assert reply == b""
        slot, trajectory = h.open()
        r = await h.call(slot, "chat", body("chat"))
        assert r.status_code == 200 and len(trajectory.turns) == 1
        await h.assert_clean()
        assert h.server.table.stats()["inserts"] == 1

    run(fn)
