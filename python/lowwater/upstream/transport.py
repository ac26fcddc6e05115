"""The upstream connection pool: a free list of keep-alive httpcore connections.

httpcore's own pool costs O(connections²) per request
(``_assign_requests_to_connections`` counts every connection for every idle
one): at 256 requests in flight, 256 answers arriving together took 4.3 s of
CPU in that one function (8.5 M ``is_idle`` calls; ``benches/interception.py``).
:class:`FreeListTransport` checks connections out and in in O(1) and has no
bound of its own (the caller's limiter bounds concurrency).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpcore
import httpx
import trio

# httpcore's errors as httpx's (what httpx's own transport does), most specific first.
_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)


@contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for theirs, ours in _ERRORS:
            if isinstance(exc, theirs):
                raise ours(str(exc)) from exc
        raise


class FreeListTransport(httpx.AsyncBaseTransport):
    """An httpx transport over a free list of keep-alive httpcore connections (Trio only).

    Checkout pops the most recently used idle connection (dropping expired
    or server-closed ones) or opens a new one; closing a response returns
    its connection if it is idle again (body fully read), else the
    connection is gone.  Every step is O(1) in the number of connections.
    There is no bound: the caller's limiter bounds concurrency.

    Args:
        max_idle: idle connections kept; more are closed on return.
        keepalive_expiry_s: an idle connection older than this is not reused (seconds).
    """

    def __init__(self, *, max_idle: int = 1024, keepalive_expiry_s: float = 5.0) -> None:
        self.max_idle = max_idle
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: dict[tuple[bytes, bytes, int], list[httpcore.AsyncHTTPConnection]] = {}
        self._idle_count = 0
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0
        self.pruned = 0

    def _checkout(
        self, origin: httpcore.Origin, stale: list[httpcore.AsyncHTTPConnection]
    ) -> httpcore.AsyncHTTPConnection:
        idle = self._idle.get((origin.scheme, origin.host, origin.port))
        while idle:
            connection = idle.pop()
            self._idle_count -= 1
            if connection.is_idle() and not connection.has_expired():
                return connection
            stale.append(connection)  # expired, or closed by the server while idle
        if origin.scheme == b"https" and self._ssl is None:
            import certifi

            self._ssl = ssl.create_default_context(cafile=certifi.where())
        self.opened += 1
        return httpcore.AsyncHTTPConnection(origin, ssl_context=self._ssl, keepalive_expiry=self.keepalive_expiry_s)

    def _checkin(self, connection: httpcore.AsyncHTTPConnection, origin: httpcore.Origin) -> bool:
        if not connection.is_idle():
            return False
        if self._idle_count >= self.max_idle:
            return False
        self._idle.setdefault((origin.scheme, origin.host, origin.port), []).append(connection)
        self._idle_count += 1
        return True

    @property
    def idle(self) -> int:
        """Idle connections held for reuse."""
        return self._idle_count

    async def prune(self) -> int:
        """Close every idle connection past its keep-alive expiry or closed by
        the server; returns how many were closed.

        Checkout only drops stale connections it meets at the top of a LIFO
        list, so after a burst the rest stayed forever: in `lowwater proxy`,
        1,024 idle upstream connections (sockets the upstream had closed, left
        in CLOSE_WAIT, with their h11 state) held 87 MB of RSS after 8,192
        rollouts had ended.  An owner calls this periodically (the interception
        server does, every ``keepalive_expiry_s``).
        """
        stale: list[httpcore.AsyncHTTPConnection] = []
        for key, connections in list(self._idle.items()):
            fresh = []
            for connection in connections:
                # has_expired() also polls the socket: a server-side close counts.
                if connection.is_idle() and not connection.has_expired():
                    fresh.append(connection)
                else:
                    stale.append(connection)
            if len(fresh) == len(connections):
                continue
            self._idle_count -= len(connections) - len(fresh)
            if fresh:
                self._idle[key] = fresh
            else:
                del self._idle[key]
        self.pruned += len(stale)  # counted with the idle count it lowered, before any await
        if stale:
            with trio.CancelScope(shield=True):
                for connection in stale:
                    await connection.aclose()
        return len(stale)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        origin = httpcore.Origin(url.raw_scheme, url.raw_host, port)
        core = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        stale: list[httpcore.AsyncHTTPConnection] = []
        connection = self._checkout(origin, stale)
        if stale:
            with trio.CancelScope(shield=True):
                for old in stale:
                    await old.aclose()
        try:
            with _httpx_errors():
                response = await connection.handle_async_request(core)
        except BaseException:
            with trio.CancelScope(shield=True):
                await connection.aclose()
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=ResponseStream(response.stream, self, connection, origin),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        idle, self._idle, self._idle_count = self._idle, {}, 0
        with trio.CancelScope(shield=True):
            for connections in idle.values():
                for connection in connections:
                    await connection.aclose()


class ResponseStream(httpx.AsyncByteStream):
    """A response body read straight from its connection; closing it returns
    the connection to the free list (or closes it if the body was not read)."""

    def __init__(
        self, stream: Any, pool: FreeListTransport, connection: httpcore.AsyncHTTPConnection, origin: httpcore.Origin
    ) -> None:
        self._stream = stream
        self._pool = pool
        self._connection: httpcore.AsyncHTTPConnection | None = connection
        self._origin = origin

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        # Shielded: closing an unfinished response closes its socket, which is
        # how a cancelled call reaches the upstream; it must not be skipped.
        with trio.CancelScope(shield=True):
            with _httpx_errors():
                await self._stream.aclose()
            if not self._pool._checkin(connection, self._origin):
                await connection.aclose()
