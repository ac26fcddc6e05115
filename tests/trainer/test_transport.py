"""Shard transports: the bulk listener's fetch into reserved payloads, the
registry hook, references of another transport through ShardConsumer and
clear_batch (removal, drain, what is still held), and store binds."""

from __future__ import annotations

import logging

import httpx
import numpy as np
import pytest
import trio

from lowwater import plugins as plugins_mod
from lowwater.hookspecs import hookimpl
from lowwater.http import serve
from lowwater.http.exposure import ExposureError
from lowwater.trainer.drain import clear_batch
from lowwater.trainer.shards import ShardConsumer, ShardMissing, ShardRef, ShardStore
from lowwater.trainer.transport import HttpTransport, ShardTransport


async def _owner(fn, **store_kwargs):
    async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
        store = ShardStore(**store_kwargs)
        await nursery.start(store.run)
        try:
            await fn(store, client)
        finally:
            nursery.cancel_scope.cancel()


def test_fetch_goes_through_the_bulk_listener_into_the_buffer():
    async def body(store, client):
        big = np.random.default_rng(0).integers(0, 255, (3, 1 << 20), dtype=np.uint8)  # 3 MiB: mapped
        refs = [
            store.put("big", big, dtype="uint8", shape=big.shape),
            store.put("empty", b"", dtype="float32", shape=(0,)),
            store.put("small", np.arange(5, dtype=np.int64), dtype="int64", shape=(5,)),
        ]
        consumer = ShardConsumer(client, chunk_size=2)
        views = await consumer.fetch([refs[2], refs[0], refs[1]])
        assert consumer.http._bulk_addresses[store.address] == store.bulk_address
        np.testing.assert_array_equal(np.frombuffer(views[0], np.int64), np.arange(5))
        np.testing.assert_array_equal(np.frombuffer(views[1], np.uint8).reshape(views[1].shape), big)
        assert views[2].nbytes == 0 and views[1].owner == store.address
        stats = consumer.buffer.stats()
        assert stats["entries"] == 3 and stats["bytes"] == big.nbytes + 40
        del views
        assert consumer.drain(["big", "empty", "small"])["stats"]["bytes"] == 0
        with pytest.raises(ShardMissing) as info:
            await consumer.fetch([refs[2], ShardRef("ghost", store.address, "int64", (1,), 8)])
        assert info.value.missing == ["ghost"]
        await consumer.aclose()

    trio.run(_owner, body)


def test_a_keyed_store_refuses_requests_without_the_key_on_both_listeners():
    async def body(store, client):
        ref = store.put("a", np.ones(4, np.float32), dtype="float32", shape=(4,))
        assert (await client.get(f"http://{store.address}/shards/stats")).status_code == 401
        with pytest.raises(Exception, match="401"):
            await ShardConsumer(client).fetch([ref])
        async with httpx.AsyncClient(timeout=30, headers={"authorization": "Bearer sesame"}) as keyed:
            consumer = ShardConsumer(keyed)
            (view,) = await consumer.fetch([ref])
            assert np.frombuffer(view, np.float32).tolist() == [1, 1, 1, 1]
            await consumer.aclose()

    trio.run(lambda: _owner(body, admin_key="sesame"))


def test_a_store_bound_beyond_loopback_needs_the_admin_key():
    async def main():
        async with trio.open_nursery() as nursery:
            with pytest.raises(ExposureError, match="LOWWATER_ADMIN_KEY"):
                await nursery.start(ShardStore().run, "0.0.0.0")
            address = await nursery.start(
                lambda task_status: ShardStore(admin_key="k").run(
                    "0.0.0.0", advertise="example.test", task_status=task_status
                )
            )
            assert address.startswith("example.test:")
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_without_a_bulk_listener_fetch_falls_back_to_the_batch_endpoint():
    async def main():
        async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
            store = ShardStore()
            store.address = await nursery.start(serve, store)
            ref = store.put("a", np.arange(3, dtype=np.int64), dtype="int64", shape=(3,))
            consumer = ShardConsumer(client)
            (view,) = await consumer.fetch([ref])
            assert np.frombuffer(view, np.int64).tolist() == [0, 1, 2]
            assert consumer.http._bulk_addresses[store.address] is None
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_shard_ref_json_keeps_its_transport_not_its_handle():
    ref = ShardRef("a", "node", "uint8", (2,), 2, "mem", handle=object())
    again = ShardRef.from_json(ref.to_json())
    assert again == ref and again.transport == "mem" and again.handle is None
    assert "transport" not in ShardRef("a", "h:1", "uint8", (2,), 2).to_json()


class MemTransport(ShardTransport):
    """A transport whose "object store" is a dict; the owner's copies and the
    consumer's views are tracked so held() can say what is still alive."""

    name = "mem"
    store: dict[str, bytes] = {}

    def __init__(self) -> None:
        self.views: dict[str, np.ndarray] = {}
        self.removed: list[str] = []
        self.kept: list = []

    def put(self, shard_id, data, *, dtype, shape):
        MemTransport.store[shard_id] = bytes(data)
        return ShardRef(shard_id, "mem", dtype, tuple(shape), len(bytes(data)), "mem", handle=shard_id)

    async def fetch(self, refs):
        out = []
        for ref in refs:
            view = np.frombuffer(MemTransport.store[ref.handle], ref.dtype).reshape(ref.shape)
            self.views[ref.shard_id] = view
            out.append(view)
        return out

    async def remove(self, refs):
        self.removed += [r.shard_id for r in refs]
        return sum(MemTransport.store.pop(r.shard_id, None) is not None for r in refs)

    def drain(self, shard_ids):
        return sum(self.views.pop(i, None) is not None for i in shard_ids)

    def stats(self):
        return {"entries": len(self.views), "bytes": sum(v.nbytes for v in self.views.values())}

    async def held(self, refs):
        return [{"shard_id": i, "nbytes": 1, "where": "test"} for i in self.kept]


class MemPlugin:
    @hookimpl
    def register_shard_transports(self, register):
        register("mem", MemTransport)


def test_register_shard_transports_and_mixed_refs_through_a_consumer_and_clear_batch(caplog):
    plugins = plugins_mod.load(extra=[("mem", MemPlugin())])
    assert plugins.shard_transport("http") is HttpTransport
    mem = plugins.shard_transport("mem")()

    async def body(store, client):
        http_ref = store.put("h", np.arange(4, dtype=np.int32), dtype="int32", shape=(4,))
        mem_ref = mem.put("m", np.arange(3, dtype=np.float32).tobytes(), dtype="float32", shape=(3,))
        consumer = ShardConsumer(client, transports={"mem": mem})
        views = await consumer.fetch([mem_ref, http_ref])
        assert views[0].tolist() == [0, 1, 2] and np.frombuffer(views[1], np.int32).tolist() == [0, 1, 2, 3]
        assert consumer.stats()["entries"] == 2
        del views
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve, consumer)
            mem.kept = ["m"]  # the transport says a view outlived the drain
            with caplog.at_level(logging.WARNING, logger="lowwater.trainer.shards"):
                report = await clear_batch(
                    [http_ref, mem_ref], client=client, consumers=[address], local=store, transports={"mem": mem}
                )
            nursery.cancel_scope.cancel()
        assert mem.removed == ["m"] and report.owners_removed["mem"] == 1
        assert report.consumers[address]["stats"]["entries"] == 0 and report.leaked_bytes == 0
        assert report.held == ({"shard_id": "m", "nbytes": 1, "where": "test"},)
        assert "still held after the drain" in caplog.text
        await consumer.aclose()

    trio.run(_owner, body)
