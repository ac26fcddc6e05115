"""The in-process harnesses' HTTP client frees a request body with its response.

httpx ties ``Response.stream`` back to the response: a reference cycle that
keeps the request body alive until the cyclic GC runs.  With the GC off,
refcounts show whether a body outlives the response that was dropped.
"""

from __future__ import annotations

import gc
import sys

import httpx
import pytest
import trio

from lowwater.http import serve
from lowwater.upstream.agent_client import AgentClient

from .upstream import Upstream


async def _refs_after_post(client: httpx.AsyncClient, url: str, body: bytes) -> int:
    before = sys.getrefcount(body)
    response = await client.post(url, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["choices"]
    del response
    return sys.getrefcount(body) - before


@pytest.mark.parametrize(("make", "leaked"), [(lambda: AgentClient(max_idle=4), False), (httpx.AsyncClient, True)])
def test_request_body_is_freed_with_the_response(make, leaked):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % (b"x" * (1 << 20))

    async def main():
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, Upstream())
            async with make() as client:
                gc.disable()
                try:
                    extra = await _refs_after_post(client, f"http://{address}/v1/chat/completions", body)
                finally:
                    gc.enable()
            nursery.cancel_scope.cancel()
        return extra

    # AgentClient: no reference left; plain httpx: the cycle still holds it
    # (the control shows the test can fail).
    assert (trio.run(main) > 0) == leaked
