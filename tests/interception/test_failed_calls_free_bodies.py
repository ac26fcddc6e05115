"""A failed upstream call frees its request body at once, not when the cyclic GC runs.

An upstream that closes mid-answer made the handler keep its error, whose
context held the upstream client's frames and with them a view of the
intercept: 30 calls of 4 MiB left 12 MiB in the table's ``live_bytes`` a
minute later.  With the GC off, ``live_bytes`` shows whether a discarded
body is still viewed, and a count of the server's per-call objects whether
anything a call held (a rewritten body with ``--model``) outlived it.
"""

from __future__ import annotations

import gc

import httpx
import pytest
import trio

from lowwater.interception import InterceptionServer
from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient

from ._harness import GUARD_S

CALLS = 8
BODY_CHARS = 256 << 10


async def _cutting_upstream(partial: bytes, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """An upstream that reads a whole request, sends ``partial`` (a response cut short) and closes."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handler(stream: trio.SocketStream) -> None:
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some(65536)
            if not data:
                return
            buffer += data
        head, _, rest = buffer.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        while len(rest) < length:
            data = await stream.receive_some(65536)
            if not data:
                return
            rest += data
        await stream.send_all(partial)
        await stream.aclose()

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


WHOLE = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"id":'
STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b'1e\r\ndata: {"choices": [], "x": 1}\n\n\r\n'
)


def _calls_alive() -> int:
    return sum(type(o).__name__ == "_Call" for o in gc.get_objects())


async def _closed_port(nursery: trio.Nursery) -> int:
    """A port nothing listens on: every call to it is refused."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    return port


def _failing_calls(upstream, call, *, model: str | None = None) -> tuple[dict, int, Trajectory]:
    """``CALLS`` times ``await call(http, slot)`` through an interception server
    forwarding to the port ``await upstream(nursery)`` returns, with the cyclic
    GC off from just before the first call until the server has drained.
    Returns the table's stats, how many more of the server's per-call objects
    are alive than before, and the rollout's trajectory."""

    async def main() -> tuple[dict, int, Trajectory]:
        async with trio.open_nursery() as nursery:
            port = await upstream(nursery)
            async with (
                ModelClient(f"http://127.0.0.1:{port}/v1", retries=0, model=model) as model_client,
                httpx.AsyncClient(timeout=GUARD_S) as http,
            ):
                server = InterceptionServer(model_client)
                await nursery.start(server.run)
                slot = server.register(Trajectory("r"))
                gc.collect()
                gc.disable()
                before = _calls_alive()
                try:
                    with trio.fail_after(GUARD_S):
                        for _ in range(CALLS):
                            await call(http, slot)
                        while server.stats()["waiting_handlers"] or len(server.table):
                            await trio.sleep(0.01)
                    stats = server.table.stats()
                    calls = _calls_alive() - before
                finally:
                    gc.enable()
            nursery.cancel_scope.cancel()
        return stats, calls, slot.trajectory

    return trio.run(main)


@pytest.mark.parametrize("model", [None, "renamed"], ids=["raw", "rewritten"])
@pytest.mark.parametrize(("stream", "partial"), [(False, WHOLE), (True, STREAM)], ids=["whole", "stream"])
def test_upstream_closing_mid_answer_leaves_no_body_alive(stream, partial, model):
    request = {"model": "m", "messages": [{"role": "user", "content": "x" * BODY_CHARS}], "stream": stream}

    async def call(http, slot):
        headers = {"authorization": f"Bearer {slot.secret}"}
        async with http.stream("POST", slot.base_url + "/chat/completions", json=request, headers=headers) as r:
            try:
                await r.aread()
            except httpx.HTTPError:
                pass  # a stream broken off: the agent's SDK raises
            assert r.status_code == (200 if stream else 502)

    stats, calls, trajectory = _failing_calls(
        lambda nursery: nursery.start(_cutting_upstream, partial), call, model=model
    )
    assert len(trajectory.turns) == CALLS and all(t.error for t in trajectory.turns)
    assert stats["entries"] == 0 and stats["inserts"] == CALLS
    assert stats["live_bytes"] == 0, stats
    assert calls == 0


def test_unreachable_upstream_leaves_no_body_alive():
    request = {"model": "m", "messages": [{"role": "user", "content": "x" * BODY_CHARS}]}

    async def call(http, slot):
        headers = {"authorization": f"Bearer {slot.secret}"}
        r = await http.post(slot.base_url + "/chat/completions", json=request, headers=headers)
        assert r.status_code == 502

    stats, calls, _ = _failing_calls(_closed_port, call)
    assert stats["live_bytes"] == 0 and calls == 0, stats
