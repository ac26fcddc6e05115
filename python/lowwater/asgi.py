"""Small ASGI building blocks for lowwater's own HTTP endpoints, served by hypercorn on Trio.

Only what the shard and buffer endpoints need: bounded body reads, JSON and
raw-bytes responses, and :func:`serve`, which runs an app inside the caller's
nursery (``await nursery.start(serve, app)``) and reports the bound address.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class HTTPError(Exception):
    """An error answered with ``status`` and a JSON body ``{"error": reason, **extra}``."""

    def __init__(self, status: int, reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.extra = extra


async def read_body(receive: Receive, limit_bytes: int) -> bytes:
    """The whole request body; :class:`HTTPError` 413 past ``limit_bytes``, 400 if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected before the body was complete")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise HTTPError(413, f"body over the limit of {limit_bytes} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    """Decode a JSON body; :class:`HTTPError` 400 naming the problem."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"malformed JSON: {exc}") from None


def id_list(payload: Any, key: str = "ids") -> list[str]:
    """``payload[key]`` as a list of str; :class:`HTTPError` 400 otherwise."""
    ids = payload.get(key) if isinstance(payload, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise HTTPError(400, f'body must be a JSON object with "{key}": a list of strings')
    return ids


async def send_bytes(
    send: Send, status: int, body: bytes | memoryview, content_type: str, headers: Iterable[tuple[str, str]] = ()
) -> None:
    raw_headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    # A memoryview goes through as is: hypercorn's h11 writer accepts any
    # bytes-like body, which saves a full copy of a large shard on the loop.
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any) -> None:
    await send_bytes(send, status, orjson.dumps(payload), "application/json")


async def send_error(send: Send, err: HTTPError) -> None:
    await send_json(send, err.status, {"error": err.reason, **err.extra})


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the ASGI lifespan protocol (nothing to set up)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def handle(
    scope: Scope, receive: Receive, send: Send, route: Callable[[Scope, Receive, Send], Awaitable[None]]
) -> None:
    """Run ``route`` for an HTTP request; answer lifespan; turn :class:`HTTPError` into its response."""
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    if scope["type"] != "http":
        return
    try:
        await route(scope, receive, send)
    except HTTPError as err:
        await send_error(send, err)


async def serve(
    app: Callable[[Scope, Receive, Send], Awaitable[None]],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"host:port"``.

    Port 0 lets the OS choose.  Cancelling the enclosing scope stops the server.
    """
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("lowwater.http")
    # Large shards take longer than hypercorn's 5 s defaults on a loaded box.
    config.keep_alive_timeout = 60
    config.h11_max_incomplete_size = 64 * 1024

    async def _serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn_serve(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(_serve)
        task_status.started(binds[0].split("://", 1)[1])
