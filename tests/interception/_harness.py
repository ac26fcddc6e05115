"""Test harness: the scripted upstream, a model client and the interception server in one nursery."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio
import trio.testing

from lowwater.http import serve
from lowwater.interception import InterceptionServer
from lowwater.trajectory import Trajectory
from lowwater.upstream.client import ModelClient

from .upstream import Upstream

KINDS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# Every test body runs under this deadline: a handler left waiting fails the
# test instead of hanging the suite.  It is a guard, not a timing assertion.
GUARD_S = 20


@attrs.define
class Harness:
    server: InterceptionServer
    upstream: Upstream
    model: ModelClient
    http: httpx.AsyncClient
    upstream_url: str

    def open(self, rollout_id: str = "r0") -> tuple[Any, Trajectory]:
        trajectory = Trajectory(rollout_id)
        return self.server.register(trajectory), trajectory

    async def call(
        self, slot: Any, kind: str, body: dict[str, Any], *, auth: str = "bearer", **kw: Any
    ) -> httpx.Response:
        """POST ``body`` to the slot (non-streamed read) with the slot's secret."""
        headers = {"authorization": f"Bearer {slot.secret}"} if auth == "bearer" else {"x-api-key": slot.secret}
        return await self.http.post(slot.base_url + PATHS[kind].removeprefix("/v1"), json=body, headers=headers, **kw)

    async def assert_clean(self) -> None:
        """No intercept left in the table, no handler waiting.

        A client has its answer a moment before the server-side handler
        runs its ``finally``; let every task run until all are blocked first.
        """
        for _ in range(100):
            await trio.testing.wait_all_tasks_blocked()
            if len(self.server.table) == 0 and self.server.stats()["waiting_handlers"] == 0:
                return
            await trio.sleep(0.01)
        stats = self.server.stats()
        assert len(self.server.table) == 0, stats
        assert stats["waiting_handlers"] == 0, stats


def body(
    kind: str,
    text: str = "what is 2 plus 2",
    *,
    stream: bool = False,
    history: list[Any] | None = None,
    model: str = "m",
    **extra: Any,
) -> dict[str, Any]:
    """A minimal valid request of ``kind`` whose last user message is ``text``."""
    messages = [*(history or []), {"role": "user", "content": text}]
    if kind == "chat":
        out: dict[str, Any] = {"model": model, "messages": messages}
    elif kind == "responses":
        out = {"model": model, "input": messages}
    else:
        out = {"model": model, "max_tokens": 64, "messages": messages}
    if stream:
        out["stream"] = True
    return {**out, **extra}


@asynccontextmanager
async def harness(*, client: dict[str, Any] | None = None, **server: Any) -> AsyncIterator[Harness]:
    """Upstream + ModelClient(**client) + InterceptionServer(**server), torn down on exit."""
    upstream = Upstream()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve, upstream)
        url = f"http://{address}/v1"
        options = {"retries": 0, "backoff_s": 0.0, **(client or {})}
        async with ModelClient(url, **options) as model, httpx.AsyncClient(timeout=GUARD_S) as http:
            proxy = InterceptionServer(model, **server)
            await nursery.start(proxy.run)
            try:
                with trio.fail_after(GUARD_S):
                    yield Harness(proxy, upstream, model, http, url)
            finally:
                nursery.cancel_scope.cancel()


def run(fn: Any, **kwargs: Any) -> None:
    """``trio.run`` an ``async def fn(h: Harness)`` inside a fresh harness."""

    async def main() -> None:
        async with harness(**kwargs) as h:
            await fn(h)

    trio.run(main)


async def read_sse(response: httpx.Response) -> list[bytes]:
    """The raw events of a streamed response (``httpx`` stream mode)."""
    raw = b"".join([chunk async for chunk in response.aiter_bytes()])
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()]
