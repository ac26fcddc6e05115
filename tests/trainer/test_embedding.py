"""The trainer API: batches of groups as shards, released everywhere at step end."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import trio

from lowwater.http import serve
from lowwater.trainer import Batch, Lowwater, SyncLowwater, TrainerConfig
from lowwater.trainer.producer import SHARD_NAMES, group_advantages
from lowwater.trainer.shards import ShardConsumer


def test_async_steps_leave_store_buffers_and_registry_empty():
    async def main():
        async with (
            Lowwater.open(TrainerConfig(group_size=2, concurrency=2)) as lw,
            httpx.AsyncClient(timeout=30) as client,
            trio.open_nursery() as nursery,
        ):
            consumer = ShardConsumer(client)
            address = await nursery.start(serve, consumer)
            for step in range(3):
                batch = await lw.next_batch(3)
                assert isinstance(batch, Batch) and batch.step == step
                assert len(batch.refs) == 3 * len(SHARD_NAMES) and batch.errors == 0
                assert lw.stats()["engine"]["trajectories"] == 0  # evicted once turned into shards
                assert lw.stats()["shards"]["entries"] == len(batch.refs)
                views = await consumer.fetch(batch.refs)
                arrays = [np.frombuffer(v, v.dtype).reshape(v.shape) for v in views]
                for g in range(3):
                    ids, logprobs, mask, offsets, rewards, advantages = arrays[g * 6 : (g + 1) * 6]
                    assert ids.dtype == np.int64 and logprobs.dtype == np.float32 and mask.dtype == np.uint8
                    assert len(ids) == len(logprobs) == len(mask) == offsets[-1] > 0  # token ids were captured
                    assert list(rewards) == [1.0, 1.0] and list(advantages) == [0.0, 0.0]
                del views, arrays
                report = await lw.clear_batch(batch, consumers=[address])
                assert report.leaked_bytes == 0
                assert lw.stats()["shards"]["entries"] == 0 and consumer.buffer.stats()["entries"] == 0
            assert lw.stats()["intercepts"]["entries"] == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_sync_wrapper_for_non_trio_trainers():
    with SyncLowwater(TrainerConfig(group_size=2)) as lw:
        batch = lw.next_batch(2)
        assert len(batch.rewards) == 2 and all(len(r) == 2 for r in batch.rewards)
        assert lw.stats()["shards"]["bytes"] == batch.nbytes
        lw.clear_batch(batch)
        assert lw.stats()["shards"]["bytes"] == 0


def test_grpo_advantages():
    assert group_advantages([1.0, 1.0]) == [0.0, 0.0]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(adv, [1, -1, -1, 1], atol=1e-5)
    assert group_advantages([]) == []


def test_groups_in_env_workers_upload_their_shards_to_the_trainer(tmp_path):
    """With workers the trainer process owns every shard; workers keep
    nothing, and the same workers serve every step (the pool lives as long
    as the trainer)."""
    from multiprocessing import forkserver, resource_tracker

    import psutil

    async def main():
        config = TrainerConfig(group_size=2, concurrency=2, workers=2)
        async with Lowwater.open(config) as lw, httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
            consumer = ShardConsumer(client)
            address = await nursery.start(serve, consumer)
            for step in range(2):
                batch = await lw.next_batch(3)
                assert batch.step == step and batch.errors == 0
                assert len(batch.refs) == 3 * len(SHARD_NAMES)
                assert {r.owner for r in batch.refs} == {lw.store.address}  # this process owns them
                assert lw.stats()["shards"]["entries"] == len(batch.refs)
                views = await consumer.fetch(batch.refs)
                ids, logprobs, mask, offsets = (np.frombuffer(v, v.dtype) for v in views[:4])
                assert len(ids) == len(logprobs) == len(mask) == offsets[-1] > 0  # token ids came through
                del views, ids, logprobs, mask, offsets
                report = await lw.clear_batch(batch, consumers=[address])
                assert report.leaked_bytes == 0 and lw.stats()["shards"]["entries"] == 0
                assert lw.pool_reports[-1]["tasks"] == 3 and lw.pool_reports[-1]["failed_tasks"] == 0
                pids.append({w["pid"] for w in lw.stats()["pool"]["workers"].values()})
            nursery.cancel_scope.cancel()
        assert lw.pool_report["tasks"] == 6 and lw.pool_report["workers_started"] == 2

    pids: list[set] = []
    try:
        trio.run(main)
        assert pids[0] == pids[1] and len(pids[0]) == 2  # kept across steps
        # The workers are gone once the trainer is closed.
        server = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
        assert all(not s.children() for s in server)
    finally:
        forkserver._forkserver._stop()  # test-only private API: later suites count child processes
        resource_tracker._resource_tracker._stop()


def test_a_worker_due_to_retire_waits_until_its_step_is_cleared():
    """max_tasks_per_worker=1: every worker is due to retire after one group,
    yet none exits before the step it served is cleared."""
    from multiprocessing import forkserver, resource_tracker

    async def main():
        config = TrainerConfig(group_size=2, concurrency=1, workers=1, max_tasks_per_worker=1)
        async with Lowwater.open(config) as lw:
            batch = await lw.next_batch(1)
            served = lw.pool_reports[-1]
            await trio.sleep(0.5)
            workers = lw.stats()["pool"]["workers"]
            retiree = [w for w in workers.values() if w["pinned"] == ["s0"]]
            assert len(retiree) == 1 and retiree[0]["state"] == "retiring"
            await lw.clear_batch(batch)
            with trio.fail_after(30):
                while any(w["pid"] == retiree[0]["pid"] for w in lw.stats()["pool"]["workers"].values()):
                    await trio.sleep(0.05)
            batch = await lw.next_batch(1)  # served by the replacement
            assert batch.errors == 0 and served["tasks"] == 1
            await lw.clear_batch(batch)

    try:
        trio.run(main)
    finally:
        forkserver._forkserver._stop()  # test-only private API: later suites count child processes
        resource_tracker._resource_tracker._stop()


def test_a_backend_other_than_local_needs_workers():
    with pytest.raises(ValueError, match="backend 'ray' runs env workers"):
        TrainerConfig(backend="ray")


def test_errors_reach_the_trainer_as_themselves(monkeypatch):
    """Neither the trainer's own exception nor one ``next_batch`` documents
    comes out wrapped in the nurseries' exception groups (``except
    BufferFull`` must catch it)."""
    from lowwater import BufferFull
    from lowwater.trainer import api
    from lowwater.trainer.shards import ShardStore

    class StopTraining(Exception):
        pass

    async def main():
        with pytest.raises(StopTraining, match="from the training loop") as raised:
            async with Lowwater.open(TrainerConfig(group_size=1)):
                raise StopTraining("from the training loop")
        assert type(raised.value) is StopTraining
        # A shard store too small for one shard: the group's error is BufferFull itself.
        monkeypatch.setattr(api, "ShardStore", lambda: ShardStore(capacity_bytes=16))
        with pytest.raises(BufferFull):
            async with Lowwater.open(TrainerConfig(group_size=2)) as lw:
                with pytest.raises(BufferFull):
                    await lw.next_batch(1)
                await lw.next_batch(1)

    trio.run(main)
