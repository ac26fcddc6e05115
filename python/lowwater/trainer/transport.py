"""Shard transports: how a shard moves from its owner (the producer) to
the consumers that read it.

A :class:`~lowwater.trainer.shards.ShardRef` names its transport
(``ref.transport``) and may carry a transport handle (``ref.handle``: for
``ray``, the owner's object reference).  The interface has four verbs:

* ``put`` (owner): hold a shard, return its reference;
* ``fetch`` (consumer): buffer-protocol views of refs, in order, zero-copy
  where the transport allows (each view has ``dtype`` and ``shape``);
* ``remove`` (owner, at step end): release the owner's copies;
* ``drain`` (consumer, at step end): release this consumer's copies.

and one check: after a step's drain the owner asks ``held(refs)`` for what
is still alive anywhere (a consumer that kept a view pins an object-store
object), which ``clear_batch`` reports as a leak.

Built in: ``"http"`` (:class:`HttpTransport`): the owner's
:class:`~lowwater.trainer.shards.ShardStore` over HTTP, fetched into the
consumer's :class:`~lowwater.FetchBuffer`; batches go through the store's
bulk listener (:mod:`lowwater.trainer.bulk`) when it has one.  Plugins add
more with the ``register_shard_transports`` hook (``lowwater-ray``:
``"ray"``, the object store).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import httpx
import orjson
import trio

from lowwater import FetchBuffer
from lowwater.trainer.bulk import BulkClient, BulkError
from lowwater.trainer.shards import (
    CONSUMER_MMAP_THRESHOLD,
    BatchReader,
    FetchRetry,
    ShardFetchError,
    ShardMissing,
    ShardRef,
    _json_or_empty,
    fetch_error,
)

if TYPE_CHECKING:
    from lowwater.trainer.shards import ShardStore


class ShardTransport(abc.ABC):
    """Base class of a shard transport (register a factory with
    ``register_shard_transports``; ``factory()`` builds this process's).

    Attributes:
        name: the name refs carry in ``ShardRef.transport``.
    """

    name: ClassVar[str] = ""

    def put(self, shard_id: str, data: Any, *, dtype: str, shape: Sequence[int]) -> ShardRef:
        """Owner side: hold ``data`` as shard ``shard_id``; its reference.

        Raises:
            NotImplementedError: this transport's shards are made elsewhere
                (``ray``: by the node pools).
        """
        raise NotImplementedError(f"shard transport {self.name!r} does not take puts here")

    @abc.abstractmethod
    async def fetch(self, refs: Sequence[ShardRef]) -> list[Any]:
        """Consumer side: views of ``refs``, in order (buffer protocol, with
        ``dtype`` and ``shape``), kept until :meth:`drain` releases them.

        Raises:
            lowwater.trainer.shards.ShardMissing: the owner no longer holds one.
            lowwater.trainer.shards.ShardFetchError: the owner cannot be reached.
        """

    @abc.abstractmethod
    async def remove(self, refs: Sequence[ShardRef]) -> int:
        """Owner side: release the owner's copies of ``refs``; how many it held."""

    @abc.abstractmethod
    def drain(self, shard_ids: Sequence[str]) -> int:
        """Consumer side: release this consumer's copies of exactly
        ``shard_ids`` (blocking; run it in a thread from a Trio task); how
        many it held."""

    def stats(self) -> dict[str, int]:
        """Consumer side: ``entries`` and ``bytes`` this consumer holds."""
        return {"entries": 0, "bytes": 0}

    async def held(self, refs: Sequence[ShardRef]) -> list[dict[str, Any]]:
        """Owner side, after every consumer drained: what of ``refs`` is still
        alive anywhere (each ``{"shard_id", "nbytes", "where"}``); ``[]`` when
        the transport cannot tell or nothing is."""
        return []

    async def aclose(self) -> None:  # noqa: B027 (optional: most transports hold nothing to close)
        """Release connections and clients."""


class HttpTransport(ShardTransport):
    """``"http"``: shards in the owner's store, fetched into a fetch buffer.

    Args:
        client: the ``httpx.AsyncClient`` that reaches owners (``None``: one
            of its own, closed by :meth:`aclose`).  Its ``authorization``
            header, if set, is also sent to bulk listeners.
        buffer: the consumer's fetch buffer (a new one by default, mapping
            payloads of 64 KiB and more).
        store: the owner's store, for :meth:`put` and local :meth:`remove`.
        chunk_size: ids per batch request.
        max_concurrency: batch requests in flight at once.
        retry: policy for connection errors.
    """

    name = "http"

    def __init__(
        self,
        client: httpx.AsyncClient | None = None,
        buffer: FetchBuffer | None = None,
        *,
        store: ShardStore | None = None,
        chunk_size: int = 64,
        max_concurrency: int = 8,
        retry: FetchRetry | None = None,
    ) -> None:
        if chunk_size < 1 or max_concurrency < 1:
            raise ValueError("chunk_size and max_concurrency must be >= 1")
        self._own_client = client is None
        self.client = client if client is not None else httpx.AsyncClient(timeout=60)
        self.buffer = buffer if buffer is not None else FetchBuffer(mmap_threshold=CONSUMER_MMAP_THRESHOLD)
        self.store = store
        self.chunk_size = chunk_size
        self.limiter = trio.CapacityLimiter(max_concurrency)
        self.retry = retry or FetchRetry()
        key = _bearer(self.client.headers.get("authorization", ""))
        self.bulk = BulkClient(self.buffer, key=key, timeout_s=_timeout_s(self.client))
        self._bulk_addresses: dict[str, str | None] = {}

    def put(self, shard_id: str, data: Any, *, dtype: str, shape: Sequence[int]) -> ShardRef:
        if self.store is None:
            raise NotImplementedError("this HttpTransport has no store to put into")
        return self.store.put(shard_id, data, dtype=dtype, shape=shape)

    async def fetch(self, refs: Sequence[ShardRef]) -> list[Any]:
        misses: dict[str, list[str]] = {}
        for ref in refs:
            if ref.shard_id not in self.buffer:
                ids = misses.setdefault(ref.owner, [])
                if ref.shard_id not in ids:
                    ids.append(ref.shard_id)
        if misses:
            try:
                async with trio.open_nursery() as nursery:
                    for owner, ids in misses.items():
                        for start in range(0, len(ids), self.chunk_size):
                            nursery.start_soon(self._fetch_chunk, owner, ids[start : start + self.chunk_size])
            except* (ShardMissing, ShardFetchError) as group:
                raise fetch_error(group) from None
        views = []
        for ref in refs:
            view = self.buffer.get(ref.shard_id)
            if view is None:
                # Drained concurrently between the fetch and this read.
                raise ShardFetchError(f"shard {ref.shard_id!r} was drained while being fetched")
            views.append(view)
        return views

    async def remove(self, refs: Sequence[ShardRef]) -> int:
        """Local refs from :attr:`store`; others with ``DELETE /shards`` to their owner."""
        by_owner: dict[str, list[str]] = {}
        for ref in refs:
            by_owner.setdefault(ref.owner, []).append(ref.shard_id)
        removed = 0
        for owner, ids in by_owner.items():
            if self.store is not None and owner == self.store.address:
                removed += await trio.to_thread.run_sync(self.store.remove, ids)
                continue
            r = await self.client.request("DELETE", f"http://{owner}/shards", content=orjson.dumps({"ids": ids}))
            r.raise_for_status()
            removed += int(r.json()["removed"])
        return removed

    def drain(self, shard_ids: Sequence[str]) -> int:
        return self.buffer.clear(list(shard_ids)) if shard_ids else 0

    def stats(self) -> dict[str, int]:
        s = self.buffer.stats()
        return {"entries": s["entries"], "bytes": s["bytes"]}

    async def aclose(self) -> None:
        await self.bulk.aclose()
        if self._own_client:
            await self.client.aclose()

    # -- fetching one chunk of ids from one owner ----------------------------------

    async def _fetch_chunk(self, owner: str, ids: list[str]) -> None:
        request = orjson.dumps({"ids": ids})
        for attempt in range(self.retry.attempts):
            try:
                async with self.limiter:
                    bulk = await self._bulk_address(owner)
                    if bulk is not None:
                        await self._bulk_fetch(owner, bulk, ids)
                    else:
                        await self._stream_batch(owner, f"http://{owner}/shards/batch", request)
                return
            except (*_RETRYABLE, OSError, trio.BrokenResourceError, BulkError) as exc:
                if isinstance(exc, BulkError) and exc.status:
                    raise ShardFetchError(f"owner {owner} answered {exc.status}: {exc}") from exc
                # A cut stream is retried whole: re-putting a shard replaces it.
                if attempt + 1 == self.retry.attempts:
                    raise ShardFetchError(f"owner {owner} unreachable after {attempt + 1} attempts: {exc!r}") from exc
                self._bulk_addresses.pop(owner, None)  # the owner may have restarted elsewhere
                await trio.sleep(self.retry.delay_s(attempt))

    async def _bulk_address(self, owner: str) -> str | None:
        """The owner's bulk listener (``GET /bulk``), cached; ``None`` when it has none."""
        if owner not in self._bulk_addresses:
            r = await self.client.get(f"http://{owner}/bulk")
            if r.status_code not in (200, 404):  # 401: a key problem, not a store without bulk
                raise ShardFetchError(f"owner {owner} answered {r.status_code}: {r.text[:200]}")
            self._bulk_addresses[owner] = r.json().get("address") if r.status_code == 200 else None
        return self._bulk_addresses[owner]

    async def _bulk_fetch(self, owner: str, address: str, ids: list[str]) -> None:
        try:
            await self.bulk.fetch(address, owner, ids)
        except BulkError as exc:
            if exc.status == 400 and (missing := exc.body.get("missing")):
                raise ShardMissing(owner, list(missing)) from None
            raise

    async def _stream_batch(self, owner: str, url: str, request: bytes) -> None:
        # Streamed, never ``response.content``: httpx's request/response objects
        # sit in reference cycles, so a body kept on the response lives until
        # the cyclic GC runs (a one-step-per-step RSS sawtooth in
        # benches/trainer_steps.py).  Here only one shard is assembled at a time.
        async with self.client.stream("POST", url, content=request) as response:
            if response.status_code != 200:
                await response.aread()
                if response.status_code == 400 and (missing := _json_or_empty(response).get("missing")):
                    raise ShardMissing(owner, missing)
                raise ShardFetchError(f"owner {owner} answered {response.status_code}: {response.text[:200]}")
            reader = BatchReader()
            async for chunk in response.aiter_raw():
                for meta, payload in reader.feed(chunk):
                    self.buffer.put(meta["id"], payload, dtype=meta["dtype"], shape=tuple(meta["shape"]), owner=owner)
            reader.close()


_RETRYABLE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.PoolTimeout)


def _bearer(value: str) -> str | None:
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _timeout_s(client: httpx.AsyncClient) -> float:
    read = client.timeout.read
    return math.inf if read is None else float(read)


def transport_factory(plugins: Any, name: str) -> Callable[[], ShardTransport]:
    """The factory registered for shard transport ``name``.

    Raises:
        lowwater.plugins.UnknownName: no plugin registered it.
    """
    factory: Callable[[], ShardTransport] = plugins.shard_transport(name)
    return factory


__all__ = ["HttpTransport", "ShardTransport", "transport_factory"]
