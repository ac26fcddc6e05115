"""Shards: the owner's shard store, consumers' fetch, and the step-end drain.

A *shard* is a contiguous tensor payload (bytes + dtype + shape) produced for
a trainer.  Its producer keeps it in a :class:`ShardStore` (owner side, a
:class:`~lowwater.FetchBuffer`) and hands out :class:`ShardRef` references.
Consumers resolve references with :meth:`ShardConsumer.fetch` into their own
fetch buffer, and at step end :func:`clear_batch` removes the owner's copies
and tells every consumer to drain exactly those ids (docs/design.md#incidents: the
consumer processes that grew ~2 GB per step because only the controller
drained).

Wire format (payloads travel as raw bytes, never base64 JSON):

* ``PUT /shards/{id}`` with headers ``x-lowwater-dtype`` and
  ``x-lowwater-shape`` (comma-separated ints, empty for a scalar).
* ``GET /shards/{id}``: the payload, with the same headers; 404 if absent.
* ``POST /shards/batch`` ``{"ids": [...]}``: 400 naming missing ids, else a
  framed body: one :mod:`lowwater.framing` frame (4-byte little-endian
  length ``n``, ``n`` bytes of JSON ``[{"id", "dtype", "shape", "nbytes"},
  ...]``), then the payloads in order, unframed.
* ``DELETE /shards`` ``{"ids": [...]}``: ``{"removed": n, "stats": {...}}``.
* ``GET /shards/stats``: the store's fetch-buffer stats.
* ``GET /bulk``: ``{"address": "host:port"}`` of the store's bulk listener
  (:mod:`lowwater.trainer.bulk`, the same batch request without the ASGI
  server's copies), 404 when it has none.

A store started with :meth:`ShardStore.run` on a host beyond loopback
requires its admin key on every request (``Authorization: Bearer``).

Consumers answer ``POST /buffer/drain`` ``{"ids": [...]}`` with
``{"removed": n, "stats": {...}}`` and ``GET /buffer/stats``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import attrs
import httpx
import orjson
import trio

from lowwater import BufferFull, FetchBuffer, LowwaterError, ShardView
from lowwater._native import DTYPES
from lowwater.backoff import full_jitter
from lowwater.framing import FrameDecoder, FrameError, encode_frame
from lowwater.http import (
    HTTPError,
    Receive,
    Router,
    Scope,
    Send,
    id_list,
    parse_json,
    read_body,
    require_key,
    send_bytes,
    send_json,
    start_response,
)
from lowwater.memory import Trimmer

log = logging.getLogger("lowwater.trainer.shards")

DTYPE_HEADER = "x-lowwater-dtype"
SHAPE_HEADER = "x-lowwater-shape"
#: Largest single request body the shard endpoints accept (bytes).
MAX_BODY_BYTES = 1 << 31
#: mmap threshold (bytes) of a consumer's default fetch buffer.
CONSUMER_MMAP_THRESHOLD = 64 * 1024


class ShardMissing(LowwaterError):
    """The owner does not hold some requested shards; ``missing`` lists their ids."""

    def __init__(self, owner: str, missing: list[str]) -> None:
        super().__init__(f"owner {owner} does not hold {len(missing)} shard(s): {missing[:10]}")
        self.owner = owner
        self.missing = missing


class ShardFetchError(LowwaterError):
    """An owner could not be reached, or answered with an error, after retries."""


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class ShardRef:
    """A lightweight reference to one shard held by its owner.

    Attributes:
        shard_id: the shard's id, unique within a step.
        owner: ``host:port`` of the owner's shard store (another transport:
            where the owner is, for logs).
        dtype: numpy-style element type name (``"int64"``, ``"float32"``, ...).
        shape: dimensions; ``prod(shape) * itemsize(dtype) == nbytes``.
        nbytes: payload size in bytes.
        transport: the shard transport that moves it
            (:mod:`lowwater.trainer.transport`; ``"http"`` by default).
        handle: the transport's handle, if it needs one (``ray``: the owner's
            object reference); not part of equality and not in
            :meth:`to_json` (such refs travel pickled).
    """

    shard_id: str
    owner: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)
    nbytes: int
    transport: str = "http"
    handle: Any = attrs.field(default=None, eq=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {
            "shard_id": self.shard_id,
            "owner": self.owner,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }
        if self.transport != "http":
            out["transport"] = self.transport
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardRef:
        return cls(d["shard_id"], d["owner"], d["dtype"], tuple(d["shape"]), d["nbytes"], d.get("transport", "http"))


def _shape_header(shape: Iterable[int]) -> str:
    return ",".join(str(int(d)) for d in shape)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(",")) if text else ()
    except ValueError:
        raise HTTPError(400, f"{SHAPE_HEADER} must be comma-separated ints, got {text!r}") from None


def encode_batch_header(views: Sequence[ShardView]) -> bytes:
    header = orjson.dumps(
        [{"id": v.shard_id, "dtype": v.dtype, "shape": list(v.shape), "nbytes": v.nbytes} for v in views]
    )
    return encode_frame(header, max_frame=MAX_BODY_BYTES)


class BatchReader:
    """Incremental parser of a framed batch body: feed chunks, get shards as they complete.

    Holds at most one shard's payload (plus the header) at a time.
    """

    def __init__(self) -> None:
        self._header = FrameDecoder(max_frame=MAX_BODY_BYTES)
        self._metas: list[dict[str, Any]] | None = None
        self._next = 0
        self._payload: bytearray | None = None
        self._filled = 0

    def feed(self, chunk: bytes) -> list[tuple[dict[str, Any], bytearray]]:
        out: list[tuple[dict[str, Any], bytearray]] = []
        view = memoryview(chunk)
        while view:
            if self._metas is None:
                self._header.feed(view)
                view = view[len(view) :]
                try:
                    header = self._header.next_frame()
                except FrameError as exc:
                    raise ShardFetchError(f"batch response header: {exc}") from None
                if header is None:
                    break
                self._metas = orjson.loads(header)
                view = memoryview(self._header.take_buffered())  # the payloads' first bytes
                out.extend(self._complete_empty())
                continue
            if self._next >= len(self._metas):
                raise ShardFetchError("batch response is longer than its header says")
            meta = self._metas[self._next]
            if self._payload is None:
                self._payload = bytearray(meta["nbytes"])
                self._filled = 0
            take = min(len(view), meta["nbytes"] - self._filled)
            self._payload[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == meta["nbytes"]:
                out.append((meta, self._payload))
                self._payload = None
                self._next += 1
                out.extend(self._complete_empty())
        return out

    def _complete_empty(self) -> list[tuple[dict[str, Any], bytearray]]:
        # Zero-byte shards complete without any payload bytes arriving.
        out = []
        assert self._metas is not None
        while self._next < len(self._metas) and self._metas[self._next]["nbytes"] == 0 and self._payload is None:
            out.append((self._metas[self._next], bytearray()))
            self._next += 1
        return out

    def close(self) -> None:
        """Raise :class:`ShardFetchError` unless every announced shard arrived."""
        if self._metas is None or self._next != len(self._metas):
            raise ShardFetchError("truncated batch response")


def decode_batch(body: bytes) -> list[tuple[dict[str, Any], bytearray]]:
    """Split a whole framed batch body into ``(meta, payload)`` pairs."""
    reader = BatchReader()
    out = reader.feed(body)
    reader.close()
    return out


class ShardStore:
    """The owner side: shards this process produced, served to consumers.

    Args:
        capacity_bytes: bound on held payload bytes (``None``: unbounded);
            a put over it raises :class:`~lowwater.BufferFull`.
        address: ``host:port`` written into references; :meth:`run` sets it
            (or the caller, from ``await nursery.start(serve, store)``).
        admin_key: the key every request must carry (``None``: none; a
            store bound beyond loopback requires one, see :meth:`run`).
    """

    def __init__(self, capacity_bytes: int | None = None, address: str = "", admin_key: str | None = None) -> None:
        self.buffer = FetchBuffer(capacity_bytes)
        self.address = address
        self.admin_key = admin_key
        #: ``host:port`` of the bulk listener, once :meth:`run` started it.
        self.bulk_address: str | None = None
        # First match wins: the fixed paths before /shards/{id} (a shard may
        # still be called "stats" or "batch": its PUT and GET go through).
        self._router = Router()
        for method, path, handler in (
            ("GET", "/bulk", self._bulk),
            ("GET", "/shards/stats", self._stats),
            ("POST", "/shards/batch", self._batch),
            ("DELETE", "/shards", self._remove),
            ("GET", "/shards/{shard_id:path}", self._send_one),
            ("PUT", "/shards/{shard_id:path}", self._receive_one),
        ):
            self._router.add(method, path, self._keyed(handler))

    def put(self, shard_id: str, data: Any, *, dtype: str, shape: Sequence[int]) -> ShardRef:
        """Copy ``data`` in and return its reference.  Raises as :meth:`FetchBuffer.put`."""
        self.buffer.put(shard_id, data, dtype=dtype, shape=tuple(shape), owner=self.address)
        return ShardRef(shard_id, self.address, dtype, tuple(shape), math.prod(shape) * DTYPES[dtype])

    def remove(self, shard_ids: Iterable[str]) -> int:
        """Remove the given shards (unknown ids skipped); returns how many were removed."""
        return self.buffer.clear(list(shard_ids))

    def stats(self) -> dict[str, int]:
        return self.buffer.stats()

    async def run(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise: str | None = None,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the endpoints and the bulk listener until cancelled;
        ``task_status.started`` gets (and :attr:`address` is set to) the
        advertised ``host:port`` written into references.

        ``advertise`` is the host others dial (default: ``host``, or this
        host's primary address for ``0.0.0.0``/``::``).

        Raises:
            lowwater.http.exposure.ExposureError: ``host`` is beyond loopback
                and the store has no ``admin_key``.
            OSError: the address cannot be bound.
        """
        from lowwater.http import serve
        from lowwater.http.exposure import advertised_host, check_bind, join
        from lowwater.trainer.bulk import serve_bulk

        check_bind("the shard store", host, self.admin_key)
        public = advertised_host(host, advertise)
        async with trio.open_nursery() as nursery:
            bulk_port = await nursery.start(
                functools.partial(serve_bulk, self.buffer, host, 0, admin_key=self.admin_key)
            )
            bound = await nursery.start(serve, self, host, port)
            self.bulk_address = join(public, bulk_port)
            self.address = join(public, int(bound.rpartition(":")[2]))
            task_status.started(self.address)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app serving the shard endpoints."""
        await self._router(scope, receive, send)

    def _keyed(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> Any:
        """``handler`` behind the admin-key check (inside the router, which
        answers a 401 sent before the body was read with ``connection: close``)."""

        async def keyed(scope: Scope, receive: Receive, send: Send) -> None:
            require_key(scope, self.admin_key)
            await handler(scope, receive, send)

        return keyed

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.stats())

    async def _bulk(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.bulk_address is None:
            raise HTTPError(404, "this store has no bulk listener")
        await send_json(send, 200, {"address": self.bulk_address})

    async def _batch(self, scope: Scope, receive: Receive, send: Send) -> None:
        ids = id_list(parse_json(await read_body(scope, receive, 16 << 20)))
        await self._send_batch(send, ids)

    async def _remove(self, scope: Scope, receive: Receive, send: Send) -> None:
        ids = id_list(parse_json(await read_body(scope, receive, 16 << 20)))
        removed = await trio.to_thread.run_sync(self.remove, ids)
        await send_json(send, 200, {"removed": removed, "stats": self.stats()})

    async def _send_one(self, scope: Scope, receive: Receive, send: Send) -> None:
        shard_id = scope["path_params"]["shard_id"]
        view = self.buffer.get(shard_id)
        if view is None:
            raise HTTPError(404, f"shard {shard_id!r} is not held here", missing=[shard_id])
        headers = [(DTYPE_HEADER, view.dtype), (SHAPE_HEADER, _shape_header(view.shape))]
        await send_bytes(send, 200, memoryview(view), "application/octet-stream", headers)

    async def _receive_one(self, scope: Scope, receive: Receive, send: Send) -> None:
        shard_id = scope["path_params"]["shard_id"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        dtype = headers.get(DTYPE_HEADER)
        if not dtype:
            raise HTTPError(400, f"missing header {DTYPE_HEADER}")
        shape = _parse_shape(headers.get(SHAPE_HEADER, ""))
        body = await read_body(scope, receive, MAX_BODY_BYTES)
        try:
            # The copy into the table releases the GIL for large payloads.
            ref = await trio.to_thread.run_sync(lambda: self.put(shard_id, body, dtype=dtype, shape=shape))
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        except BufferFull as exc:
            raise HTTPError(507, str(exc)) from None
        await send_json(send, 201, ref.to_json())

    async def _send_batch(self, send: Send, ids: list[str]) -> None:
        views = [self.buffer.get(i) for i in ids]
        missing = [i for i, v in zip(ids, views) if v is None]
        if missing:
            raise HTTPError(400, f"{len(missing)} shard(s) not held here", missing=missing)
        present = [v for v in views if v is not None]
        header = encode_batch_header(present)
        total = len(header) + sum(v.nbytes for v in present)
        await start_response(send, 200, "application/octet-stream", content_length=total)
        # One body message per shard, each a zero-copy view of the payload:
        # the response is never assembled in one buffer here.
        await send({"type": "http.response.body", "body": header, "more_body": bool(present)})
        for n, view in enumerate(present):
            await send({"type": "http.response.body", "body": memoryview(view), "more_body": n + 1 < len(present)})


@attrs.define
class FetchRetry:
    """How a consumer retries connection errors to a shard owner: ``attempts``
    tries, :func:`lowwater.backoff.full_jitter` between them (seconds).
    (Not :class:`lowwater.rollout.RetryPolicy`, which retries whole rollouts by error class.)"""

    attempts: int = 4
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def delay_s(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (0-based)."""
        return full_jitter(attempt, self.base_delay_s, self.max_delay_s)


_DEFAULT_TRIM: Any = object()


class ShardConsumer:
    """A consumer's side: resolves references into its own fetch buffer, drains on request.

    References of another transport (``ref.transport``, such as ``"ray"``)
    are fetched and drained through that transport
    (:mod:`lowwater.trainer.transport`), looked up in ``transports`` or, the
    first time one is seen, in the plugin registry; its entries count in
    the drain's stats, so a view kept past the drain is reported as a leak.

    Args:
        client: the ``httpx.AsyncClient`` used to reach owners (caller-owned).
        buffer: the fetch buffer to fill (a new unbounded one by default).
        chunk_size: ids per ``POST /shards/batch`` request.
        max_concurrency: batch requests in flight at once.
        retry: policy for connection errors.
        trim: called after a drain that removed something (in the drain's
            worker thread): by default a rate-limited guarded ``malloc_trim``,
            since the step's transient response bodies otherwise stay in
            glibc's heap (a 25 MB RSS sawtooth per consumer in
            benches/trainer_steps.py).  ``None`` disables it.
        transports: shard transports by name for references that are not
            ``"http"`` (default: built from the registry when needed).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        buffer: FetchBuffer | None = None,
        *,
        chunk_size: int = 64,
        max_concurrency: int = 8,
        retry: FetchRetry | None = None,
        trim: Callable[[], object] | None = _DEFAULT_TRIM,
        transports: dict[str, Any] | None = None,
    ) -> None:
        from lowwater.trainer.transport import HttpTransport

        if chunk_size < 1 or max_concurrency < 1:
            raise ValueError("chunk_size and max_concurrency must be >= 1")
        self.client = client
        # Consumer buffers turn over every step: payloads of 64 KiB and more get
        # their own mapping, so a drain gives their pages back at once instead
        # of leaving them to glibc's heap (benches/trainer_steps.py showed a
        # 1-step-per-step RSS sawtooth with the 1 MiB default).
        self.buffer = buffer if buffer is not None else FetchBuffer(mmap_threshold=CONSUMER_MMAP_THRESHOLD)
        self.http = HttpTransport(
            client, self.buffer, chunk_size=chunk_size, max_concurrency=max_concurrency, retry=retry
        )
        self.chunk_size = chunk_size
        self.limiter = self.http.limiter
        self.retry = self.http.retry
        self.trim = Trimmer() if trim is _DEFAULT_TRIM else trim
        self.transports: dict[str, Any] = dict(transports or {})
        self._router = Router()
        self._router.add("POST", "/buffer/drain", self._drain_request)
        self._router.add("GET", "/buffer/stats", self._buffer_stats)

    async def fetch(self, refs: Sequence[ShardRef]) -> list[Any]:
        """Views of ``refs``, in order: local hits first, misses fetched from their owners.

        ``"http"`` references give :class:`~lowwater.ShardView` objects of
        this consumer's fetch buffer; another transport's give its own
        zero-copy views (``ray``: read-only numpy arrays over the object
        store), each with ``dtype`` and ``shape``.

        Raises:
            ShardMissing: an owner does not hold a requested shard.
            ShardFetchError: an owner stayed unreachable or answered with an error.
            lowwater.plugins.UnknownName: a reference names a transport no plugin registered.
        """
        if all(ref.transport == "http" for ref in refs):
            return await self.http.fetch(refs)
        groups: dict[str, list[int]] = {}
        for i, ref in enumerate(refs):
            groups.setdefault(ref.transport, []).append(i)
        out: list[Any] = [None] * len(refs)
        for name, positions in groups.items():
            transport = self.http if name == "http" else self._transport(name)
            views = await transport.fetch([refs[i] for i in positions])
            for i, view in zip(positions, views):
                out[i] = view
        return out

    def _transport(self, name: str) -> Any:
        if name not in self.transports:
            from lowwater import plugins as plugins_mod
            from lowwater.trainer.transport import transport_factory

            self.transports[name] = transport_factory(plugins_mod.load(), name)()
        return self.transports[name]

    def drain(self, shard_ids: Sequence[str] | None) -> dict[str, Any]:
        """Remove exactly ``shard_ids`` from the buffer (and from every other
        transport's copies); returns ``{"removed", "stats"}``.

        ``None`` or an empty list is a no-op (it must not flush: a consumer
        told nothing must keep what other steps still need).  Blocking (it
        frees payloads and may trim the heap): the drain endpoint runs it in a
        worker thread; do the same when calling it from a Trio task.  The
        stats' ``entries`` and ``bytes`` include what other transports still
        hold (a view kept past the drain).
        """
        ids = list(shard_ids or ())
        removed = self.buffer.clear(ids) if ids else 0
        for transport in self.transports.values():
            removed += transport.drain(ids) if ids else 0
        if removed and self.trim is not None:
            self.trim()
        return {"removed": removed, "stats": self.stats()}

    def stats(self) -> dict[str, int]:
        """The fetch buffer's stats, with other transports' ``entries`` and ``bytes`` added."""
        stats = self.buffer.stats()
        for transport in self.transports.values():
            extra = transport.stats()
            stats["entries"] += extra.get("entries", 0)
            stats["bytes"] += extra.get("bytes", 0)
        return stats

    async def aclose(self) -> None:
        """Close the bulk connections and any transport this consumer built."""
        await self.http.aclose()
        for transport in self.transports.values():
            await transport.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of the consumer's drain endpoints."""
        await self._router(scope, receive, send)

    async def _drain_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        ids = id_list(parse_json(await read_body(scope, receive, 64 << 20)))
        result = await trio.to_thread.run_sync(self.drain, ids)
        await send_json(send, 200, result)

    async def _buffer_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.stats())


def fetch_error(group: BaseExceptionGroup[ShardMissing | ShardFetchError]) -> LowwaterError:
    """The one error a caller of ``fetch`` sees for the chunks that failed
    (``except* (ShardMissing, ShardFetchError) as group``).

    Chunks fail independently; callers want one named error, not a group:
    the first :class:`ShardFetchError` if any, else every missing id merged
    into one :class:`ShardMissing`.  Each chunk is a direct child task of the
    fetch's nursery, so the group is flat.
    """
    errors = group.exceptions
    failed = [e for e in errors if isinstance(e, ShardFetchError)]
    if failed:
        return failed[0]
    missing = [e for e in errors if isinstance(e, ShardMissing)]
    owners = sorted({e.owner for e in missing})
    return ShardMissing(", ".join(owners), [m for e in missing for m in e.missing])


def _json_or_empty(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def __getattr__(name: str) -> Any:
    # clear_batch and DrainReport live in lowwater.trainer.drain; they were
    # importable from here (and from the deprecated lowwater.shards alias),
    # so a lazy lookup keeps those imports working without an import cycle.
    if name in ("clear_batch", "DrainReport"):
        from lowwater.trainer import drain

        return getattr(drain, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
