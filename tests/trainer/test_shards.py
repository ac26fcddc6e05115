"""Shard store, fetch and the step-end drain, in-process and across real processes."""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
import hypothesis.strategies as st
import numpy as np
import orjson
import pytest
import trio
from hypothesis import given, settings

from lowwater.http import serve
from lowwater.trainer.shards import (
    BatchReader,
    ShardConsumer,
    ShardFetchError,
    ShardMissing,
    ShardRef,
    ShardStore,
    clear_batch,
    decode_batch,
)

PROC = Path(__file__).with_name("shard_proc.py")


async def _with_owner(fn):
    async with httpx.AsyncClient(timeout=10) as client, trio.open_nursery() as nursery:
        store = ShardStore()
        store.address = await nursery.start(serve, store)
        try:
            await fn(store, client)
        finally:
            nursery.cancel_scope.cancel()


def test_fetch_preserves_order_and_is_zero_copy():
    async def body(store, client):
        arrays = {f"s{i}": np.arange(i * 10, i * 10 + 7, dtype=np.float32).reshape(1, 7) for i in range(5)}
        refs = [store.put(k, a, dtype="float32", shape=a.shape) for k, a in arrays.items()]
        assert refs[0] == ShardRef("s0", store.address, "float32", (1, 7), 28)
        consumer = ShardConsumer(client, chunk_size=2)
        order = [refs[3], refs[0], refs[4], refs[0]]
        views = await consumer.fetch(order)
        for ref, view in zip(order, views):
            got = np.frombuffer(view, view.dtype).reshape(view.shape)
            np.testing.assert_array_equal(got, arrays[ref.shard_id])
            assert view.owner == store.address
        again = np.frombuffer(views[0], np.float32)
        assert np.shares_memory(again, np.frombuffer(views[0], np.float32))
        # Only misses go over the wire: a second fetch is all hits.
        before = consumer.buffer.stats()["inserts"]
        await consumer.fetch(order)
        assert consumer.buffer.stats()["inserts"] == before == 3

    trio.run(_with_owner, body)


def test_missing_shards_are_named():
    async def body(store, client):
        store.put("present", b"\x00" * 8, dtype="int64", shape=(1,))
        consumer = ShardConsumer(client)
        ghost = ShardRef("ghost", store.address, "int64", (1,), 8)
        with pytest.raises(ShardMissing) as info:
            await consumer.fetch([ShardRef("present", store.address, "int64", (1,), 8), ghost])
        assert info.value.missing == ["ghost"]
        r = await client.get(f"http://{store.address}/shards/ghost")
        assert r.status_code == 404
        r = await client.post(f"http://{store.address}/shards/batch", content=b"{not json")
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
        r = await client.post(f"http://{store.address}/shards/batch", content=b'{"ids": [1]}')
        assert r.status_code == 400

    trio.run(_with_owner, body)


def test_put_get_delete_over_http_raw_bytes():
    async def body(store, client):
        data = np.arange(6, dtype=np.int32).tobytes()
        headers = {"x-lowwater-dtype": "int32", "x-lowwater-shape": "2,3"}
        r = await client.put(f"http://{store.address}/shards/a%2Fb", content=data, headers=headers)
        assert r.status_code == 201, r.text
        assert r.json()["shard_id"] == "a/b" and r.json()["nbytes"] == 24
        r = await client.put(f"http://{store.address}/shards/bad", content=data[:5], headers=headers)
        assert r.status_code == 400 and "do not match" in r.json()["error"]
        r = await client.get(f"http://{store.address}/shards/a%2Fb")
        assert r.content == data and r.headers["x-lowwater-shape"] == "2,3"
        r = await client.post(f"http://{store.address}/shards/batch", content=orjson.dumps({"ids": ["a/b"]}))
        [(meta, payload)] = decode_batch(r.content)
        assert meta == {"id": "a/b", "dtype": "int32", "shape": [2, 3], "nbytes": 24} and bytes(payload) == data
        r = await client.request(
            "DELETE", f"http://{store.address}/shards", content=orjson.dumps({"ids": ["a/b", "nope"]})
        )
        assert r.json()["removed"] == 1 and r.json()["stats"]["entries"] == 0
        # The id is the path as the server decoded it once: "%41" stays in the id.
        r = await client.put(f"http://{store.address}/shards/{quote('x%41', safe='')}", content=data, headers=headers)
        assert r.status_code == 201 and r.json()["shard_id"] == "x%41"
        # Fixed paths come first; a shard may still be called "stats".
        r = await client.put(f"http://{store.address}/shards/stats", content=data, headers=headers)
        assert r.status_code == 201 and r.json()["shard_id"] == "stats"
        r = await client.get(f"http://{store.address}/shards/stats")
        assert r.json()["entries"] == 2
        r = await client.post(f"http://{store.address}/shards/x")
        assert r.status_code == 405 and r.headers["allow"] == "GET, PUT"

    trio.run(_with_owner, body)


def test_no_arg_drain_is_a_no_op():
    consumer = ShardConsumer(httpx.AsyncClient())
    consumer.buffer.put("keep", b"\x01" * 4, dtype="uint8", shape=(4,))
    assert consumer.drain(None) == {"removed": 0, "stats": consumer.buffer.stats()}
    assert consumer.drain([])["removed"] == 0
    assert "keep" in consumer.buffer
    assert consumer.drain(["keep", "unknown"])["removed"] == 1


def _start(role: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(PROC), role], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    return proc, orjson.loads(proc.stdout.readline())["address"]


def _ask(proc: subprocess.Popen, cmd: dict) -> dict:
    proc.stdin.write(orjson.dumps(cmd).decode() + "\n")
    return orjson.loads(proc.stdout.readline())


def test_steps_across_processes_leave_every_buffer_empty(caplog):
    owner, owner_addr = _start("owner")
    consumers = [_start("consumer") for _ in range(2)]
    try:
        n, elems = 12, 20_000  # 160 KB shards, 12 per step
        for step in range(3):
            refs = _ask(owner, {"make": step, "n": n, "elems": elems})["refs"]
            expected = [int((np.arange(elems, dtype=np.int64) + step * 1_000_000 + i * 1000).sum()) for i in range(n)]
            for proc, _ in consumers:
                # Each consumer fetches a different half, plus one shared shard.
                reply = _ask(proc, {"fetch": refs})
                assert reply["sums"] == expected
                assert reply["stats"]["entries"] == n

            async def drain():
                async with httpx.AsyncClient(timeout=10) as client:
                    return await clear_batch(
                        [ShardRef.from_json(r) for r in refs], client=client, consumers=[a for _, a in consumers]
                    )

            with caplog.at_level(logging.WARNING, logger="lowwater.trainer.shards"):
                report = trio.run(drain)
            assert report.owners_removed == {owner_addr: n}
            assert report.leaked_bytes == 0
            for _, addr in consumers:
                assert report.consumers[addr]["removed"] == n
                assert report.consumers[addr]["stats"]["entries"] == 0
            assert _ask(owner, {"stats": True})["entries"] == 0
            for proc, _ in consumers:
                stats = _ask(proc, {"stats": True})
                assert (stats["entries"], stats["bytes"], stats["live_bytes"]) == (0, 0, 0)
        assert not [r for r in caplog.records if "leak" in r.getMessage()]
    finally:
        for proc in [owner] + [p for p, _ in consumers]:
            proc.stdin.close()
            proc.wait(timeout=10)


def test_leak_and_unreachable_consumer_are_warnings_not_errors(caplog):
    async def body(store, client):
        async with trio.open_nursery() as nursery:
            consumer = ShardConsumer(client)
            addr = await nursery.start(serve, consumer)
            ref = store.put("x", b"\x00" * 16, dtype="uint8", shape=(16,))
            await consumer.fetch([ref])
            consumer.buffer.put("stray", b"\x00" * 32, dtype="uint8", shape=(32,))
            with caplog.at_level(logging.WARNING, logger="lowwater.trainer.shards"):
                report = await clear_batch([ref], client=client, consumers=[addr, "127.0.0.1:9"])
            assert report.leaked_bytes == 32
            assert report.consumers["127.0.0.1:9"] is None
            messages = " ".join(r.getMessage() for r in caplog.records)
            assert "32 bytes" in messages and "127.0.0.1:9" in messages
            nursery.cancel_scope.cancel()

    trio.run(_with_owner, body)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, 64, 1000]), max_size=6),
    cuts=st.lists(st.integers(1, 300), max_size=30),
)
def test_batch_reader_reassembles_any_chunking(sizes, cuts):
    """Shards arrive whole and in order however the stream is cut."""
    payloads = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    metas = [{"id": f"s{i}", "dtype": "uint8", "shape": [n], "nbytes": n} for i, n in enumerate(sizes)]
    header = orjson.dumps(metas)
    body = struct.pack("<I", len(header)) + header + b"".join(payloads)
    reader = BatchReader()
    got, pos = [], 0
    for cut in cuts + [len(body)]:
        got.extend(reader.feed(body[pos : pos + cut]))
        pos += cut
        if pos >= len(body):
            break
    reader.close()
    assert [(m["id"], bytes(p)) for m, p in got] == [(m["id"], p) for m, p in zip(metas, payloads)]


def test_batch_reader_refuses_truncation_and_overrun():
    header = orjson.dumps([{"id": "a", "dtype": "uint8", "shape": [4], "nbytes": 4}])
    body = struct.pack("<I", len(header)) + header + b"abcd"
    reader = BatchReader()
    reader.feed(body[:-1])
    with pytest.raises(ShardFetchError, match="truncated"):
        reader.close()
    reader = BatchReader()
    with pytest.raises(ShardFetchError, match="longer"):
        reader.feed(body + b"x")
