"""A shard consumer as a Ray actor: how a trainer's Ray workers read a batch.

The actor holds a :class:`~lowwater.trainer.shards.ShardConsumer` (``ray``
refs are read zero-copy from the object store through
:class:`~lowwater_ray.transport.RayTransport`, ``http`` refs fetched into
its fetch buffer) and serves the consumer's drain endpoints on its own Trio
thread, so the trainer's ``clear_batch(batch, consumers=[address])``
drains it like any consumer::

    Consumer = ray.remote(ConsumerActor).options(num_cpus=0)
    consumer = Consumer.remote()
    address = ray.get(consumer.address.remote())
    ray.get(consumer.fetch.remote(list(batch.refs)))    # views kept until the drain
    await lw.clear_batch(batch, consumers=[address])

A real trainer worker subclasses it and computes on the views in
``fetch``; :meth:`ConsumerActor.retain` keeps views past the drain, which
``clear_batch`` then reports as a leak (its tests use it).
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import httpx
import numpy as np
import trio

from lowwater.http import serve
from lowwater.trainer.shards import ShardConsumer, ShardRef


class ConsumerActor:
    """Wrap with ``ray.remote``; see the module docstring.

    Args:
        host: where the drain endpoints bind (loopback by default: the
            trainer process on the same machine drains it).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._retained: list[Any] = []
        self._up = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="lowwater-consumer", daemon=True)
        self._thread.start()
        if not self._up.wait(60):
            raise RuntimeError("the consumer's drain endpoints did not start")

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
            self.consumer = ShardConsumer(client)
            self._address = await nursery.start(serve, self.consumer, self._host, 0)
            self._up.set()
            await trio.sleep_forever()

    def pid(self) -> int:
        """This actor's process id (its RSS is the consumer's)."""
        return os.getpid()

    def address(self) -> str:
        """``host:port`` of the drain endpoints (``clear_batch``'s ``consumers``)."""
        return str(self._address)

    def fetch(self, refs: list[ShardRef]) -> list[dict[str, Any]]:
        """Fetch ``refs``; per view ``shard_id``, ``dtype``, ``shape``,
        ``nbytes``, ``sum`` (of its elements) and ``zero_copy`` (not a copy
        of the object store's bytes: read-only, backed by another buffer)."""
        views = trio.from_thread.run(self.consumer.fetch, refs, trio_token=self._token)
        out = []
        for ref, view in zip(refs, views):
            array = np.asarray(view) if isinstance(view, np.ndarray) else np.frombuffer(view, view.dtype)
            out.append(
                {
                    "shard_id": ref.shard_id,
                    "dtype": str(array.dtype),
                    "shape": list(array.shape),
                    "nbytes": int(array.nbytes),
                    "sum": float(array.sum()) if array.size else 0.0,
                    "zero_copy": (not array.flags.writeable) and array.base is not None,
                }
            )
        del views, view, array  # the consumer's transports keep them until the drain
        return out

    def retain(self, shard_ids: list[str]) -> int:
        """Keep a view of each of ``shard_ids`` past the drain (a leak, on purpose)."""
        ray_transport = self.consumer.transports.get("ray")
        held = getattr(ray_transport, "_views", {})
        self._retained += [held[i] for i in shard_ids if i in held]
        return len(self._retained)

    def release(self) -> None:
        """Drop the retained views."""
        self._retained.clear()
        gc.collect()

    def stats(self) -> dict[str, int]:
        return trio.from_thread.run_sync(self.consumer.stats, trio_token=self._token)


__all__ = ["ConsumerActor"]
