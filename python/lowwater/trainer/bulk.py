"""The shard store's bulk path: ``POST /shards/batch`` over plain HTTP/1.1 on
its own listener, sent from the owner's payloads and received into the
consumer's reserved payloads, with no copy in between.

Why a second listener: through hypercorn a 64 MiB batch took 434 ms (the
issue's measure; 313 ms here): the ASGI server copies every body message
(``bytes(body)``) and h11 joins it again, and the consumer's httpx stream
arrives in 64 KiB pieces that were assembled and copied once more into
the fetch buffer.  Here the owner's socket sends straight from each
:class:`~lowwater.ShardView` and the consumer's socket receives straight
into :meth:`lowwater.FetchBuffer.reserve`'s pending payload, so the bytes
are copied only by the kernel.  The wire format is the hypercorn
endpoint's (:mod:`lowwater.trainer.shards`): a framed JSON header, then the
payloads in order; errors are JSON bodies with the same statuses (400 with
``missing``, 401 for a wrong key, 404, 405, 413).

The listener speaks just enough HTTP/1.1 for this one request: a request
line, headers (``content-length``, ``authorization``/``x-api-key``;
``connection: close`` honoured), a body of at most 16 MiB of JSON, and
keep-alive.  It binds where the store's main server binds and asks for the
same admin key.
"""

from __future__ import annotations

import hmac
import logging
import math
from typing import TYPE_CHECKING, Any

import orjson
import trio

from lowwater.framing import HEADER, HEADER_SIZE

if TYPE_CHECKING:
    from lowwater import FetchBuffer, ShardView

log = logging.getLogger("lowwater.trainer.bulk")

#: Largest request head (bytes) and request body (bytes) the listener reads.
MAX_HEAD_BYTES = 64 * 1024
MAX_REQUEST_BYTES = 16 << 20
#: Largest batch header (bytes) a consumer accepts.
MAX_HEADER_BYTES = 64 << 20
#: Bytes asked of the kernel per receive (it returns what it has).
RECV_BYTES = 4 << 20
#: A connection idle this long (seconds) between requests is closed.
IDLE_S = 60.0

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}


class BulkError(Exception):
    """The bulk peer answered with an error or broke the protocol; ``status`` is
    the HTTP status (0 for a protocol error) and ``body`` the parsed JSON body."""

    def __init__(self, message: str, status: int = 0, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {}


# -- owner side -----------------------------------------------------------------


async def serve_bulk(
    buffer: FetchBuffer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    admin_key: str | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``buffer``'s shards on ``host:port`` until cancelled;
    ``task_status.started`` gets the bound port.

    Raises:
        OSError: the address cannot be bound.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(
            lambda stream: _serve_connection(stream, buffer, admin_key), listeners, handler_nursery=nursery
        )


async def _serve_connection(stream: Any, buffer: FetchBuffer, admin_key: str | None) -> None:
    reader = _Reader(stream.socket)
    try:
        while True:
            with trio.move_on_after(IDLE_S):
                head = await reader.head()
            if head is None:  # idle past IDLE_S, or the peer closed between requests
                return
            close = await _answer(stream, reader, head, buffer, admin_key)
            if close:
                return
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, BulkError):
        return  # the consumer went away or sent garbage: nothing to clean but the socket
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _answer(
    stream: trio.SocketStream, reader: _Reader, head: _Head, buffer: FetchBuffer, admin_key: str | None
) -> bool:
    """Answer one request; ``True`` when the connection must close after it."""
    length = head.content_length
    if length > MAX_REQUEST_BYTES:
        await _send_json(stream, 413, {"error": f"request body over {MAX_REQUEST_BYTES} bytes"}, close=True)
        return True
    body = await reader.exactly(length)
    if head.path != "/shards/batch":
        await _send_json(stream, 404, {"error": f"no route {head.path}"}, close=head.close)
        return head.close
    if head.method != "POST":
        await _send_json(stream, 405, {"error": "use POST"}, close=head.close)
        return head.close
    if admin_key is not None and not hmac.compare_digest(head.key.encode(), admin_key.encode()):
        await _send_json(stream, 401, {"error": "missing or wrong admin key"}, close=head.close)
        return head.close
    try:
        ids = orjson.loads(body)["ids"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TypeError
    except (orjson.JSONDecodeError, KeyError, TypeError):
        await _send_json(stream, 400, {"error": 'body must be {"ids": [str, ...]}'}, close=head.close)
        return head.close
    views = [buffer.get(i) for i in ids]
    missing = [i for i, v in zip(ids, views) if v is None]
    if missing:
        error = {"error": f"{len(missing)} shard(s) not held here", "missing": missing}
        await _send_json(stream, 400, error, close=head.close)
        return head.close
    present: list[ShardView] = [v for v in views if v is not None]
    meta = orjson.dumps(
        [{"id": v.shard_id, "dtype": v.dtype, "shape": list(v.shape), "nbytes": v.nbytes} for v in present]
    )
    total = HEADER_SIZE + len(meta) + sum(v.nbytes for v in present)
    response_head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {total}\r\n"
        f"{'connection: close' + chr(13) + chr(10) if head.close else ''}\r\n"
    ).encode()
    await _send_all(stream.socket, response_head + HEADER.pack(len(meta)) + meta)
    for view in present:
        # Straight from the owner's payload: the kernel is the only copy.
        await _send_all(stream.socket, memoryview(view))
    del present, views
    return head.close


async def _send_all(sock: Any, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def _send_json(stream: trio.SocketStream, status: int, body: dict[str, Any], *, close: bool) -> None:
    payload = orjson.dumps(body)
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n{'connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    ).encode()
    await _send_all(stream.socket, head + payload)


# -- consumer side --------------------------------------------------------------


class BulkClient:
    """Fetches batches from owners' bulk listeners into a fetch buffer.

    Keeps up to ``max_idle`` idle connections per bulk address for reuse.

    Args:
        buffer: the consumer's fetch buffer (shards are committed into it).
        key: the owner's admin key, sent as ``Authorization: Bearer`` (``None``: none).
        timeout_s: bound on connecting and on each wait for bytes (seconds).
    """

    def __init__(self, buffer: FetchBuffer, *, key: str | None = None, timeout_s: float = 60.0, max_idle: int = 8):
        self.buffer = buffer
        self.key = key
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self._idle: dict[str, list[trio.SocketStream]] = {}

    async def fetch(self, address: str, owner: str, ids: list[str]) -> None:
        """Fetch ``ids`` from the bulk listener at ``address`` (``host:port``)
        and commit each into the buffer (``owner`` recorded on it).

        Raises:
            BulkError: an error answer (``status``, ``body``) or a broken response.
            OSError: the connection failed (also trio.BrokenResourceError).
        """
        stream = await self._connect(address)
        ok = False
        try:
            await self._exchange(stream, address, owner, ids)
            ok = True
        finally:
            if ok and len(self._idle.setdefault(address, [])) < self.max_idle:
                self._idle[address].append(stream)
            else:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def aclose(self) -> None:
        for streams in self._idle.values():
            for stream in streams:
                await stream.aclose()
        self._idle.clear()

    async def _connect(self, address: str) -> trio.SocketStream:
        idle = self._idle.get(address)
        if idle:
            return idle.pop()
        host, _, port = address.rpartition(":")
        with trio.fail_after(self.timeout_s):
            return await trio.open_tcp_stream(host.strip("[]"), int(port))

    async def _exchange(self, stream: trio.SocketStream, address: str, owner: str, ids: list[str]) -> None:
        body = orjson.dumps({"ids": ids})
        auth = f"authorization: Bearer {self.key}\r\n" if self.key else ""
        request = (
            f"POST /shards/batch HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{auth}\r\n"
        ).encode() + body
        await stream.send_all(request)
        reader = _Reader(stream.socket, self.timeout_s)
        head = await reader.status()
        if head.status != 200:
            answer = await reader.exactly(head.content_length)
            try:
                parsed = orjson.loads(answer) if answer else {}
            except orjson.JSONDecodeError:
                parsed = {}
            raise BulkError(f"{address} answered {head.status}: {answer[:200]!r}", head.status, parsed)
        prefix = await reader.exactly(HEADER_SIZE)
        (size,) = HEADER.unpack(prefix)
        if size > MAX_HEADER_BYTES:
            raise BulkError(f"batch header of {size} bytes is over {MAX_HEADER_BYTES}")
        metas = orjson.loads(await reader.exactly(size))
        expected = HEADER_SIZE + size + sum(int(m["nbytes"]) for m in metas)
        if expected != head.content_length:
            raise BulkError(f"batch of {head.content_length} bytes announces {expected}")
        for meta in metas:
            pending = self.buffer.reserve(meta["id"], dtype=meta["dtype"], shape=tuple(meta["shape"]), owner=owner)
            try:
                if pending.nbytes:
                    target = memoryview(pending)
                    try:
                        await reader.into(target)
                    finally:
                        target.release()
                pending.commit()
            except BaseException:
                pending.abandon()
                raise


class _Head:
    """A parsed request or response head."""

    def __init__(self, first: str, headers: dict[str, str]) -> None:
        self.first = first
        self.headers = headers
        try:
            self.content_length = int(headers.get("content-length", "0"))
        except ValueError:
            raise BulkError(f"bad content-length {headers.get('content-length')!r}") from None
        if self.content_length < 0:
            raise BulkError("negative content-length")
        self.close = headers.get("connection", "").lower() == "close"

    @property
    def method(self) -> str:
        return self.first.split(" ", 1)[0]

    @property
    def path(self) -> str:
        parts = self.first.split(" ")
        return parts[1] if len(parts) > 1 else ""

    @property
    def status(self) -> int:
        parts = self.first.split(" ")
        try:
            return int(parts[1])
        except (IndexError, ValueError):
            raise BulkError(f"bad status line {self.first!r}") from None

    @property
    def key(self) -> str:
        auth = self.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return self.headers.get("x-api-key", "").strip()


class _Reader:
    """Reads a socket: heads through a small buffer, payloads straight into
    the caller's memory (``recv_into``); bytes read past a head are kept."""

    def __init__(self, sock: Any, timeout_s: float = math.inf) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.pending = bytearray()

    async def _recv(self, n: int) -> bytes:
        with trio.fail_after(self.timeout_s):
            data: bytes = await self.sock.recv(n)
            return data

    async def _head(self) -> _Head | None:
        while b"\r\n\r\n" not in self.pending:
            if len(self.pending) > MAX_HEAD_BYTES:
                raise BulkError(f"head over {MAX_HEAD_BYTES} bytes")
            chunk = await self._recv(65536)
            if not chunk:
                if self.pending:
                    raise BulkError("connection closed inside a head")
                return None
            self.pending += chunk
        raw, _, rest = bytes(self.pending).partition(b"\r\n\r\n")
        self.pending = bytearray(rest)
        lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return _Head(lines[0], headers)

    async def head(self) -> _Head | None:
        """A request head, or ``None`` when the peer closed between requests."""
        return await self._head()

    async def status(self) -> _Head:
        head = await self._head()
        if head is None:
            raise BulkError("connection closed before the response")
        return head

    async def exactly(self, n: int) -> bytes:
        while len(self.pending) < n:
            chunk = await self._recv(max(65536, n - len(self.pending)))
            if not chunk:
                raise BulkError("connection closed inside a body")
            self.pending += chunk
        out = bytes(self.pending[:n])
        del self.pending[:n]
        return out

    async def into(self, target: memoryview) -> None:
        """Fill ``target`` exactly: buffered bytes first, then the socket."""
        filled = min(len(self.pending), len(target))
        if filled:
            target[:filled] = self.pending[:filled]
            del self.pending[:filled]
        while filled < len(target):
            with trio.fail_after(self.timeout_s):
                got = await self.sock.recv_into(target[filled:], min(RECV_BYTES, len(target) - filled))
            if not got:
                raise BulkError("connection closed inside a payload")
            filled += got


__all__ = ["BulkClient", "BulkError", "serve_bulk"]
