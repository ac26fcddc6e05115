"""The node pool: a Ray actor per node running lowwater's unchanged
:class:`~lowwater.workers.WorkerPool`.

Everything lowwater does for a pool of env workers (forkserver starts,
recycling by count and RSS, memory admission, heartbeats, re-runs after a
worker death, no orphans) happens inside the actor, exactly as on one
machine; Ray only places the actor on its node and carries task ids in and
rows out.  The actor hosts a Trio loop in a thread: the ``WorkerPool`` runs
there over a :class:`~lowwater.workers.stream.TaskStream`, and each Ray call
(``run``) submits one task and blocks its Ray thread until the task's rows
arrive.

Shards (trainer jobs): the workers upload a group's shards to a
:class:`~lowwater.trainer.shards.ShardStore` the actor serves on loopback
(the job's ``store_url`` is :data:`~lowwater.workers.backend.NODE_STORE_URL`);
``run`` takes them out and returns them, as numpy arrays in one dict, as
its second return value: an object-store object owned by the caller (the
driver), so the actor keeps nothing of a step once the call returns and a
dead actor loses no finished group.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Hashable
from typing import Any

import attrs
import numpy as np
import orjson
import ray
import trio

from lowwater.trainer.shards import ShardStore
from lowwater.workers import JobSpec, PoolConfig, WorkerPool
from lowwater.workers.backend import NODE_STORE_URL, PinBy
from lowwater.workers.stream import TaskAttempt, TaskStream

log = logging.getLogger("lowwater.ray")

#: Seconds a node pool gets to come up (its Trio thread and shard store).
START_S = 60.0


class PoolStopped(RuntimeError):
    """The node pool's WorkerPool ended (it failed, or the pool is stopping)."""


class _Waiter:
    __slots__ = ("done", "error", "info", "rows")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.rows: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self.error: BaseException | None = None


class NodePool:
    """A Ray actor (the backend applies ``ray.remote`` with its options).

    Args:
        spec: the job.
        config: the pool settings (``workers`` per node), already adjusted
            for this host (:func:`lowwater_ray.memory.host_marks`).
        pin_by: as :class:`~lowwater.workers.WorkerPool`'s.
    """

    def __init__(self, spec: JobSpec, config: PoolConfig, pin_by: PinBy | None) -> None:
        self._spec = spec
        self._config = config
        self._pin_by = pin_by
        self._waiters: dict[bytes, _Waiter] = {}
        self._report: dict[str, Any] | None = None
        self._failure: BaseException | None = None
        self._started = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="lowwater-node-pool", daemon=True)
        self._thread.start()
        if not self._started.wait(START_S) or self._failure is not None:
            raise PoolStopped(f"the node pool did not start: {self._failure!r}")

    # -- the Trio side -------------------------------------------------------------

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as nursery:
                self._store = ShardStore()
                await nursery.start(self._store.run)  # loopback: only this node's workers upload here
                spec = self._spec
                if spec.kwargs.get("store_url") == NODE_STORE_URL:
                    spec = attrs.evolve(spec, kwargs={**spec.kwargs, "store_url": f"http://{self._store.address}"})
                self._pool = WorkerPool(spec, self._config, pin_by=self._pin_by)
                self._stream = TaskStream()
                self._started.set()
                try:
                    report = await self._pool.run(self._stream, self._on_rows)
                    self._report = report.to_json()
                except Exception as exc:
                    self._failure = exc
                    log.error("node pool %d: its worker pool failed: %r", os.getpid(), exc)
                finally:
                    for waiter in self._waiters.values():
                        waiter.error = self._failure or PoolStopped("the node pool stopped")
                        waiter.done.set()
                    nursery.cancel_scope.cancel()
        except BaseException as exc:
            self._failure = self._failure or exc
            raise
        finally:
            store = getattr(self, "_store", None)
            if store is not None:
                store.buffer.clear()
            self._started.set()
            self._finished.set()

    async def _on_rows(self, rows: list[dict[str, Any]], info: Any) -> None:
        waiter = self._waiters.pop(orjson.dumps(info.task_id), None)
        if waiter is None:  # cannot happen: every task comes from a waiting call
            log.error("node pool: rows of task %r nobody waits for", info.task_id)
            return
        waiter.rows = rows
        waiter.info = attrs.asdict(info)
        waiter.done.set()

    async def _run(self, task_id: Any, attempt: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if self._failure is not None or self._finished.is_set():
            raise PoolStopped(f"the node pool stopped: {self._failure!r}")
        key = orjson.dumps(task_id)
        if key in self._waiters:
            raise ValueError(f"task {task_id!r} is already running on this node pool")
        waiter = self._waiters[key] = _Waiter()
        self._stream.submit([TaskAttempt(task_id, attempt)])
        await waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter.rows, waiter.info

    # -- Ray methods (each on a Ray thread) ----------------------------------------

    def ready(self) -> dict[str, Any]:
        """Where this node pool runs: ``pid``, ``node_id``, ``ip``."""
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address()}

    @ray.method(num_returns=2)
    def run(self, task_id: Any, attempt: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run one task; ``({"rows", "info"}, shards)``: shards is a dict of
        numpy arrays (shard id -> array) taken out of this node's store, the
        rows' ``refs`` are marked ``"transport": "ray"``.

        Raises:
            PoolStopped: the node pool's worker pool ended.
        """
        rows, info = trio.from_thread.run(self._run, task_id, attempt, trio_token=self._token)
        shards: dict[str, Any] = {}
        for row in rows:
            for ref in row.get("refs") or ():
                if isinstance(ref, dict) and ref.get("owner") == self._store.address:
                    view = self._store.buffer.pop(ref["shard_id"])
                    if view is None:
                        continue
                    shards[ref["shard_id"]] = _array(view, ref["dtype"], ref["shape"])
                    ref["transport"] = "ray"
        return {"rows": rows, "info": info}, shards

    def unpin(self, key: Hashable) -> int:
        return trio.from_thread.run_sync(self._pool.unpin, key, trio_token=self._token)

    def stats(self) -> dict[str, Any]:
        """The pool's live stats, with this actor's ``pid``."""
        from lowwater_ray.memory import shmem_bytes

        if self._finished.is_set():
            return {"workers": {}, "pool": {}, "pid": os.getpid(), "shmem_bytes": shmem_bytes()}
        stats = trio.from_thread.run_sync(self._pool.stats, trio_token=self._token)
        return {**stats, "pid": os.getpid(), "shmem_bytes": shmem_bytes()}

    def stop(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """Finish what was submitted, stop the workers; the pool's report."""
        if not self._finished.is_set():
            try:
                trio.from_thread.run_sync(self._stream.close, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._finished.wait(timeout_s)
        return self._report


def _array(view: Any, dtype: str, shape: list[int]) -> Any:
    """A numpy array over a shard view (numpy has no bfloat16: such shards travel as bytes)."""
    try:
        return np.frombuffer(view, dtype=np.dtype(dtype)).reshape(shape)
    except TypeError:
        return np.frombuffer(view, dtype=np.uint8)


__all__ = ["NodePool", "PoolStopped"]
