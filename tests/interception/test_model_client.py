"""The upstream model client: limiter outside httpx, retries, timeouts, cancellation."""

from __future__ import annotations

import base64

import httpx
import orjson
import psutil
import pytest
import trio
import trio.testing

from lowwater.upstream.client import ModelClient

from ._harness import body, run
from .test_failures import until


def test_concurrency_is_bounded_outside_httpx_and_cancellation_reaches_upstream():
    async def fn(h):
        h.upstream.hang = True
        raw = orjson.dumps(body("chat"))
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(h.model.post, "/v1/chat/completions", raw)
            await until(lambda: len(h.upstream.received) == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert len(h.upstream.received) == 2  # three wait on the limiter, not in httpx's pool
            assert h.model.stats()["in_flight"] == 2
            nursery.cancel_scope.cancel()
        await until(lambda: h.upstream.disconnects == 2)
        assert h.model.stats()["in_flight"] == 0
        h.upstream.hang = False
        answer = await h.model.post("/v1/chat/completions", raw)  # the client still works after cancellations
        assert answer.status == 200 and answer.content_type == "application/json"

    run(fn, client={"max_concurrency": 2})


def test_retries_honour_retry_after_and_give_up():
    async def fn(h):
        raw = orjson.dumps(body("chat"))
        h.upstream.statuses.extend([429, 503, 500])
        answer = await h.model.post("/v1/chat/completions", raw)
        stats = h.model.stats()
        assert answer.status == 500 and (stats["requests"], stats["retried"], stats["in_flight"]) == (3, 2, 0)
        h.upstream.statuses.extend([400])
        answer = await h.model.post("/v1/chat/completions", raw)
        assert answer.status == 400 and h.model.stats()["retried"] == 2  # a 4xx other than 429 is final

    run(fn, client={"retries": 2})


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "garbage", "Thu, 01 Jan 1970 00:00:00 GMT"])
def test_a_bad_retry_after_is_absent_not_a_crash(value):
    # trio.sleep(nan) raised inside the retry loop: the call was a bare 500.
    async def fn(h):
        h.upstream.retry_after = value
        h.upstream.statuses.extend([429])
        answer = await h.model.post("/v1/chat/completions", orjson.dumps(body("chat")))
        assert answer.status == 200 and h.model.stats()["retried"] == 1

    run(fn, client={"retries": 2, "backoff_s": 0.0})


def test_buffer_bodies_are_sent_without_a_copy_and_per_request_timeouts():
    async def fn(h):
        raw = bytearray(orjson.dumps(body("messages")))
        answer = await h.model.post("/v1/messages", memoryview(raw))
        assert answer.status == 200 and h.upstream.received[-1][2] == body("messages")
        assert h.upstream.received[-1][1]["content-length"] == str(len(raw))
        h.upstream.hang = True
        with pytest.raises(httpx.ReadTimeout):
            await h.model.post("/v1/messages", bytes(raw), timeout_s=0.1)

    run(fn)


def test_backoff_is_full_jitter_under_a_cap():
    client = ModelClient("http://127.0.0.1:1/v1", backoff_s=0.5, max_backoff_s=3.0)
    for attempt in range(8):
        delays = [client._delay(attempt) for _ in range(50)]
        assert all(0 <= d <= min(3.0, 0.5 * 2**attempt) for d in delays)
    assert client.url("/v1/messages") == "http://127.0.0.1:1/v1/messages"


@pytest.mark.parametrize("kwargs", [{"max_concurrency": 0}, {"retries": -1}, {"timeout_s": -1}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ModelClient("http://x/v1", **kwargs)


def test_connections_are_reused_and_a_broken_one_is_not():
    async def fn(h):
        raw = orjson.dumps(body("chat"))
        for _ in range(5):
            assert (await h.model.post("/v1/chat/completions", raw)).status == 200
        assert h.model.stats()["connections_opened"] == 1
        # A response closed before its end closes its connection (that is how
        # cancellation reaches the upstream); the next call opens a new one.
        h.upstream.hang_after = 2
        async with h.model.stream("/v1/chat/completions", orjson.dumps(body("chat", stream=True))) as response:
            async for _ in response.aiter_bytes():
                break
        await until(lambda: h.upstream.disconnects == 1)
        assert (await h.model.post("/v1/chat/completions", raw)).status == 200
        assert h.model.stats()["connections_opened"] == 2
        assert (await h.model.get("/v1/models")).status == 200
        assert h.model.stats()["connections_opened"] == 2

    run(fn)


def test_idle_connections_closed_by_the_server_are_not_reused():
    async def fn(h):
        raw = orjson.dumps(body("chat"))
        h.model.transport.keepalive_expiry_s = 0.0  # every idle connection has expired by the next call
        for _ in range(3):
            assert (await h.model.post("/v1/chat/completions", raw)).status == 200
        assert h.model.stats()["connections_opened"] == 3

    run(fn)


def test_prune_closes_idle_connections_past_their_expiry():
    async def fn(h):
        raw = orjson.dumps(body("chat"))

        async def call() -> None:
            assert (await h.model.post("/v1/chat/completions", raw)).status == 200

        h.upstream.latency_s = 0.05  # the calls overlap, so each takes its own connection
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(call)
        h.upstream.latency_s = 0.0
        stats = h.model.stats()
        assert (stats["connections_opened"], stats["connections_idle"]) == (8, 8)
        assert await h.model.prune_idle() == 0  # none has expired yet
        assert h.model.stats()["connections_idle"] == 8
        for connection in [c for pool in h.model.transport._idle.values() for c in pool][:3]:
            await connection.aclose()  # as when the upstream closes them
        assert await h.model.prune_idle() == 3
        stats = h.model.stats()
        assert (stats["connections_idle"], stats["connections_pruned"]) == (5, 3)
        await call()
        assert h.model.stats()["connections_opened"] == 8  # a kept one was reused

    run(fn, client={"keepalive_expiry_s": 600.0})


def _connections_to(port: int) -> int:
    """This process's established TCP connections to ``port`` (the data plane runs in it)."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_the_interception_server_prunes_its_upstream_pool_after_a_burst():
    async def fn(h):
        port = int(h.upstream_url.rsplit(":", 1)[1].split("/")[0])
        h.upstream.latency_s = 0.05
        slots = [h.open(f"r{i}")[0] for i in range(16)]
        async with trio.open_nursery() as nursery:
            for slot in slots:
                nursery.start_soon(h.call, slot, "chat", body("chat"))
        # A burst of 16 concurrent calls left several idle connections in the
        # plane's upstream pool (a peer kept 1,024 of them after a burst, in
        # CLOSE_WAIT once the upstream dropped them).
        assert _connections_to(port) > 1
        assert h.server.stats()["upstream"]["requests"] == 16
        # No traffic follows: only the pool's idle timeout can close them.
        await until(lambda: _connections_to(port) == 0)

    run(fn, client={"keepalive_expiry_s": 0.05})


def test_negative_keepalive_expiry_is_refused():
    with pytest.raises(ValueError):
        ModelClient("http://x/v1", keepalive_expiry_s=-1.0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("3", 3.0),
        (" 7 ", 7.0),
        ("99999", 30.0),  # clamped
        ("0", 0.0),
        ("nan", None),
        ("inf", None),
        ("-1", None),
        ("1.5", None),
        ("garbage", None),
        ("", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # in the past
        ("Wed, 21 Oct 2015 07:28:10 GMT", 10.0),
        ("Wed, 21 Oct 2015 08:28:00 GMT", 30.0),  # clamped
        (None, None),
    ],
)
def test_retry_after_is_parsed_per_rfc_9110(value, expected):
    from lowwater.upstream.client import parse_retry_after

    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert parse_retry_after(value, 30.0, now=now) == expected


def test_credentials_in_the_base_url_are_sent_as_basic_auth_and_kept_out_of_it():
    # The client sends straight to its transport, so httpx never turned URL
    # credentials into a header: a basic-auth gateway answered every call 401.
    async def fn(h):
        host = h.upstream_url.removeprefix("http://")
        async with ModelClient(f"http://us%40er:p%3Ass@{host}", api_key="k") as model:
            assert "p%3Ass" not in model.base_url and "us%40er" not in model.base_url
            answer = await model.post("/v1/chat/completions", orjson.dumps(body("chat")))
        assert answer.status == 200
        _, headers, _ = h.upstream.received[-1]
        assert headers["authorization"] == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
        assert headers["x-api-key"] == "k"

    run(fn)
