"""Serving an ASGI app with hypercorn's Trio worker inside the caller's nursery."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from lowwater.http.asgi import App
from lowwater.http.exposure import check_bind, public_address

#: Seconds an idle keep-alive connection is kept: large shards take longer
#: than hypercorn's 5 s default on a loaded box.
KEEP_ALIVE_S = 60.0
#: hypercorn's default listen backlog.
BACKLOG = 100


def hypercorn_config(host: str, port: int, *, keep_alive_s: float = KEEP_ALIVE_S, backlog: int = BACKLOG) -> Config:
    """The hypercorn config of every lowwater server: bound to ``host:port``
    (an IPv6 host in brackets), no access log, errors to the ``lowwater.http``
    logger, 64 KiB of request head at most."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("lowwater.http")
    config.keep_alive_timeout = keep_alive_s
    config.h11_max_incomplete_size = 64 * 1024
    config.backlog = backlog
    return config


async def serve(
    app: App,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    keep_alive_s: float = KEEP_ALIVE_S,
    backlog: int = BACKLOG,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"host:port"`` (``"[v6]:port"``).

    Port 0 lets the OS choose.  Cancelling the enclosing scope stops the server.

    Raises:
        OSError: the address cannot be bound (inside Trio's exception groups).
    """
    config = hypercorn_config(host, port, keep_alive_s=keep_alive_s, backlog=backlog)

    async def _serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
        # hypercorn types its app as a union of its own ASGI framework types, which our
        # structural App (lowwater.http.asgi) does not name; the call is ASGI 3 all the same.
        await hypercorn_serve(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(_serve)
        task_status.started(binds[0].split("://", 1)[1])


@asynccontextmanager
async def open_server(
    what: str,
    app: App,
    host: str,
    port: int,
    *,
    advertise: str | None,
    admin_key: str | None,
    keep_alive_s: float = KEEP_ALIVE_S,
    backlog: int = BACKLOG,
) -> AsyncIterator[tuple[trio.Nursery, str]]:
    """Serve ``app`` under the binding rules (:mod:`lowwater.http.exposure`);
    yields ``(nursery, "host:port")``: the nursery the server runs in (for
    the caller's own tasks) and the address to hand out
    (:func:`~lowwater.http.exposure.public_address`).  The server runs
    until the nursery is cancelled; leaving the block waits for that.

    Raises:
        lowwater.http.exposure.ExposureError: ``host`` is beyond loopback and
            ``admin_key`` is empty, raised before anything is started (bare,
            not inside an exception group); ``what`` names the server.
        OSError: the address cannot be bound (inside Trio's exception groups).
    """
    check_bind(what, host, admin_key)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            functools.partial(serve, app, host, port, keep_alive_s=keep_alive_s, backlog=backlog)
        )
        yield nursery, public_address(host, bound, advertise)
