"""The trainer API on the ray backend: shards through the object store, owned
by the trainer process, read zero-copy by a consumer actor on the other node;
after clear_batch the object store holds nothing of the step, and a consumer
that keeps a view is reported as a leak."""

from __future__ import annotations

import logging

import pytest
import trio

from lowwater.trainer import Lowwater, TrainerConfig
from lowwater.trainer.producer import SHARD_NAMES

pytestmark = pytest.mark.ray


async def _settled(predicate, timeout_s: float = 10.0) -> bool:
    with trio.move_on_after(timeout_s):
        while not await trio.to_thread.run_sync(predicate):
            await trio.sleep(0.1)
        return True
    return False


def test_trainer_steps_over_ray_drain_the_object_store(ray_cluster, admin_key, caplog):
    import ray

    from lowwater_ray.consumer import ConsumerActor
    from lowwater_ray.memory import holders, object_store

    def store_empty() -> bool:
        return all(s["objects"] == 0 for s in object_store().values())

    async def main():
        config = TrainerConfig(
            group_size=2, concurrency=4, workers=1, backend="ray", ray_address=ray_cluster.address, bind="0.0.0.0"
        )
        consumer = ray.remote(ConsumerActor).options(num_cpus=0, resources={"node2": 0.01}).remote()
        address = await trio.to_thread.run_sync(ray.get, consumer.address.remote())
        async with Lowwater.open(config) as lw:
            for step in range(3):
                batch = await lw.next_batch(4)
                assert batch.errors == 0 and len(batch.refs) == 4 * len(SHARD_NAMES)
                assert {r.transport for r in batch.refs} == {"ray"}
                assert lw.stats()["shards"]["entries"] == 0  # this process's store holds nothing: Ray has it
                views = await trio.to_thread.run_sync(ray.get, consumer.fetch.remote(list(batch.refs)))
                assert all(v["zero_copy"] for v in views)
                by_name = {v["shard_id"].rsplit("/", 1)[1]: v for v in views[: len(SHARD_NAMES)]}
                assert by_name["token_ids"]["shape"][0] == by_name["logprobs"]["shape"][0] > 0
                hexes = {r.handle.object_hex for r in batch.refs}
                report = await lw.clear_batch(batch, consumers=[address])
                assert report.held == () and report.leaked_bytes == 0, report
                assert report.consumers[address]["removed"] == len(batch.refs)
                assert all(r.handle.ref is None for r in batch.refs)  # the owner let go while still holding batch
                assert not await trio.to_thread.run_sync(holders, hexes)
                assert await _settled(store_empty), object_store()  # no object of the step is left

            # A consumer that keeps a view past the drain pins its object: a reported leak.
            batch = await lw.next_batch(2)
            await trio.to_thread.run_sync(ray.get, consumer.fetch.remote(list(batch.refs)))
            kept = batch.refs[0].shard_id
            assert await trio.to_thread.run_sync(ray.get, consumer.retain.remote([kept])) == 1
            with caplog.at_level(logging.WARNING, logger="lowwater.trainer.shards"):
                report = await lw.clear_batch(batch, consumers=[address])
            leaked = {h["shard_id"] for h in report.held}
            assert kept in leaked and all("pinned by a view" in h["where"] for h in report.held)
            assert report.leaked_bytes > 0 and "still held after the drain" in caplog.text
            await trio.to_thread.run_sync(ray.get, consumer.release.remote())
            assert await _settled(store_empty), object_store()
        assert lw.pool_report["tasks"] == 14 and lw.pool_report["node_pools"] == 2
        ray.kill(consumer)

    trio.run(main)
