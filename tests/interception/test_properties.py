"""Property tests over HTTP: any malformed body is a 400 and any well-formed one a recorded turn,
and neither leaves an intercept behind.

The servers run on a background Trio loop for the whole module; Hypothesis
drives a sync ``httpx`` client against them.
"""

from __future__ import annotations

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowwater.http import serve
from lowwater.interception import InterceptionServer
from lowwater.testing.background import BackgroundTrio
from lowwater.testing.strategies import malformed_bodies, request_bodies
from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient

from .upstream import Upstream

PATHS = {"openai.chat": "/chat/completions", "openai.responses": "/responses", "anthropic.messages": "/messages"}
#: Deadline of one settle (seconds): handlers end in milliseconds; generous for a loaded machine.
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def proxy():
    loop = BackgroundTrio()
    try:
        address = loop.start(serve, Upstream())
        client = ModelClient(f"http://{address}/v1", retries=0)
        server = InterceptionServer(client)
        loop.start(server.run)
        trajectory = Trajectory("prop")
        slot = loop.run_sync(server.register, trajectory)
        with httpx.Client(timeout=20, headers={"authorization": f"Bearer {slot.secret}"}) as http:
            yield loop, server, slot, trajectory, http
        loop.run(client.aclose)
    finally:
        loop.close()


def settle(loop, server) -> None:
    """Wait (on the loop) until every handler has run its ``finally``."""
    import trio
    import trio.testing

    async def wait():
        # A leaked intercept or a handler that never finishes must fail the
        # example, not loop until CI's timeout.
        with trio.move_on_after(SETTLE_S):
            while len(server.table) or server.stats()["waiting_handlers"]:
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.001)
            return
        raise AssertionError(f"not settled after {SETTLE_S} s: table {server.table.stats()}, {server.stats()}")

    loop.run(wait)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=malformed_bodies(), path=st.sampled_from(sorted(PATHS.values())))
def test_malformed_bodies_are_400(proxy, raw, path):
    loop, server, slot, trajectory, http = proxy
    before = len(trajectory.turns)
    r = http.post(slot.base_url + path, content=raw)
    assert r.status_code == 400, (raw, r.text)
    assert r.json()["error"]["message"]
    assert len(trajectory.turns) == before
    settle(loop, server)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=request_bodies())
def test_well_formed_bodies_become_turns(proxy, request):
    loop, server, slot, trajectory, http = proxy
    protocol, payload = request
    before = len(trajectory.turns)
    r = http.post(slot.base_url + PATHS[protocol], content=orjson.dumps(payload))
    assert r.status_code == 200, r.text
    (turn,) = trajectory.turns[before:]
    assert turn.protocol == protocol and turn.error is None and turn.streamed is payload.get("stream", False)
    settle(loop, server)
    assert server.table.stats()["bytes"] == 0
