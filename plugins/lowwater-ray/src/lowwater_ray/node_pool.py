"""The node pool: a Ray actor per node running lowwater's unchanged
:class:`~lowwater.workers.WorkerPool`.

Everything lowwater does for a pool of env workers (forkserver starts,
recycling by count and RSS, memory admission, heartbeats, re-runs after a
worker death, no orphans) happens inside the actor, exactly as on one
machine; Ray only places the actor on its node and carries task ids in and
rows out.  The actor hosts a Trio loop in a thread: the ``WorkerPool`` runs
there over a :class:`~lowwater.workers.stream.TaskStream`.  Ids travel in
batches and rows come back in batches: one Ray call (``exchange``) hands the
loop any number of new ids (one non-blocking ``run_sync_soon``, no wait for
the loop) and returns the rows of every task finished since the last call,
as one orjson document, waiting for the first one and then ``linger_s``
for more.  A Ray call per task and a thread hand-off each way per task cost
about 3 CPU-ms per task in this actor and a wake-up per task in the driver.

Shards (trainer jobs): the workers upload a group's shards to a
:class:`~lowwater.trainer.shards.ShardStore` the actor serves on loopback
(the job's ``store_url`` is :data:`~lowwater.workers.backend.NODE_STORE_URL`);
``exchange_shards`` (the variant such jobs use) returns at most one task
a call and takes its shards out of the store, as numpy arrays in one dict,
as its second return value: an object-store object owned by the caller
(the driver), one per group as before, so a step's release never waits on
another step's group, the actor keeps nothing of a step once the call
returns, and a dead actor loses no finished group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

import attrs
import numpy as np
import orjson
import ray
import trio

from lowwater.trainer.shards import ShardStore
from lowwater.workers import JobSpec, PoolConfig, TaskInfo, WorkerPool
from lowwater.workers.backend import NODE_STORE_URL, PinBy
from lowwater.workers.stream import TaskAttempt, TaskStream

log = logging.getLogger("lowwater.ray")

#: Seconds a node pool gets to come up (its Trio thread and shard store).
START_S = 60.0


class PoolStopped(RuntimeError):
    """The node pool's WorkerPool ended (it failed, or the pool is stopping)."""


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
        # Finished tasks, filled by the Trio thread, taken by ``exchange`` calls
        # on Ray threads: the condition is the only hand-off between them.
        self._cond = threading.Condition()
        self._done: deque[tuple[str, list[dict[str, Any]], TaskInfo]] = deque()
        self._running: set[str] = set()  # task keys submitted and not finished
        self._stopped = False
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
                    self._stop_exchanges()
                    nursery.cancel_scope.cancel()
        except BaseException as exc:
            self._failure = self._failure or exc
            raise
        finally:
            self._stop_exchanges()
            store = getattr(self, "_store", None)
            if store is not None:
                store.buffer.clear()
            self._started.set()
            self._finished.set()

    def _stop_exchanges(self) -> None:
        """Wake every waiting ``exchange``: nothing more will finish."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    async def _on_rows(self, rows: list[dict[str, Any]], info: TaskInfo) -> None:
        key = _key(info.task_id)
        with self._cond:
            if key not in self._running:  # cannot happen: every task comes from an exchange
                log.error("node pool: rows of task %r nobody submitted", info.task_id)
                return
            self._running.discard(key)
            self._done.append((key, rows, info))
            self._cond.notify_all()

    def _submit(self, attempts: list[TaskAttempt]) -> None:
        """On the Trio thread (``run_sync_soon``): queue the ids for the pool."""
        try:
            self._stream.submit(attempts)
        except trio.ClosedResourceError:  # submitted after stop: the exchanges must not wait for them
            self._failure = self._failure or PoolStopped("ids submitted after the node pool stopped")
            self._stop_exchanges()

    def _exchange(
        self, tasks: list[tuple[Any, int]], wait_s: float, linger_s: float, max_tasks: int
    ) -> list[tuple[str, list[dict[str, Any]], TaskInfo]]:
        if tasks:
            keys = [_key(task_id) for task_id, _ in tasks]
            with self._cond:
                if self._failure is not None or self._stopped:
                    raise PoolStopped(f"the node pool stopped: {self._failure!r}")
                for key, (task_id, _) in zip(keys, tasks, strict=True):
                    if key in self._running:
                        raise ValueError(f"task {task_id!r} is already running on this node pool")
                self._running.update(keys)
            try:
                # Non-blocking: this thread does not wait for the loop to run it.
                self._token.run_sync_soon(self._submit, [TaskAttempt(t, a) for t, a in tasks])
            except trio.RunFinishedError:
                raise PoolStopped(f"the node pool stopped: {self._failure!r}") from None
        now = time.monotonic()
        deadline = now + wait_s
        with self._cond:
            while not self._done and not self._stopped and now < deadline:
                self._cond.wait(deadline - now)
                now = time.monotonic()
            if self._done and linger_s > 0:
                # The first row is here: wait a little for more, so one call
                # (and one driver wake-up) carries several tasks.
                deadline = min(deadline, now + linger_s)
                while len(self._done) < max_tasks and not self._stopped and now < deadline:
                    self._cond.wait(deadline - now)
                    now = time.monotonic()
            if not self._done and self._stopped and self._running:
                raise PoolStopped(f"the node pool stopped with tasks unfinished: {self._failure!r}")
            return [self._done.popleft() for _ in range(min(max_tasks, len(self._done)))]

    # -- Ray methods (each on a Ray thread) ----------------------------------------

    def ready(self) -> dict[str, Any]:
        """Where this node pool runs: ``pid``, ``node_id``, ``ip``."""
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address()}

    def exchange(self, tasks: list[tuple[Any, int]], wait_s: float, linger_s: float, max_tasks: int) -> bytes:
        """Submit ``tasks`` (``(task_id, attempt)`` pairs) and return the
        tasks finished since the last call, at most ``max_tasks``: if none is
        finished, wait up to ``wait_s`` seconds for one, then up to
        ``linger_s`` more for others (``wait_s=0``: no wait).

        Returns:
            orjson bytes of a list of ``[key, attempt, pid, worker, status,
            rows]``, ``key`` being the task id's orjson text.

        Raises:
            PoolStopped: the node pool's worker pool ended (with tasks of
                this pool unfinished, or before ``tasks`` could be submitted).
            ValueError: a task of ``tasks`` is already running here.
        """
        return _encode(self._exchange(tasks, wait_s, linger_s, max_tasks))

    @ray.method(num_returns=2)
    def exchange_shards(
        self, tasks: list[tuple[Any, int]], wait_s: float, linger_s: float
    ) -> tuple[bytes, dict[str, Any]]:
        """As :meth:`exchange` with ``max_tasks=1``, for jobs uploading shards
        to this node's store: ``(rows, shards)``, shards being a dict of
        numpy arrays (shard id -> array) taken out of this node's store, the
        rows' ``refs`` marked ``"transport": "ray"``.  One task a call: its
        shards object is released with its group alone."""
        done = self._exchange(tasks, wait_s, linger_s, 1)
        shards: dict[str, Any] = {}
        for _, rows, _ in done:
            for row in rows:
                for ref in row.get("refs") or ():
                    if isinstance(ref, dict) and ref.get("owner") == self._store.address:
                        view = self._store.buffer.pop(ref["shard_id"])
                        if view is None:
                            continue
                        shards[ref["shard_id"]] = _array(view, ref["dtype"], ref["shape"])
                        ref["transport"] = "ray"
        return _encode(done), shards

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


def _key(task_id: Any) -> str:
    """A task id's key on both sides (ids are JSON: they reach the workers as JSON)."""
    return orjson.dumps(task_id).decode()


def _encode(done: list[tuple[str, list[dict[str, Any]], TaskInfo]]) -> bytes:
    """The rows of finished tasks as one orjson document (rows reached this
    actor as orjson from the workers; bytes cross Ray as one buffer, where a
    list of dicts would be pickled object by object)."""
    return orjson.dumps(
        [[key, info.attempt, info.pid, info.worker, info.status, rows] for key, rows, info in done],
        option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY,
    )


def _array(view: Any, dtype: str, shape: list[int]) -> Any:
    """A numpy array over a shard view (numpy has no bfloat16: such shards travel as bytes)."""
    try:
        return np.frombuffer(view, dtype=np.dtype(dtype)).reshape(shape)
    except TypeError:
        return np.frombuffer(view, dtype=np.uint8)


__all__ = ["NodePool", "PoolStopped"]
