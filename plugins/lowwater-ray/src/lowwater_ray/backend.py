"""The ``ray`` worker backend: the driver side.

``RayBackend(options).pool(spec, config)`` gives a task pool whose ``run``
connects to the cluster (``options.address``: ``"auto"``, ``HOST:PORT``, or
``None`` for a local one started and stopped here), starts one
:class:`~lowwater_ray.node_pool.NodePool` actor per alive node, pinned to it
by node affinity (``soft=False``), and spreads task ids over them, at most
``workers * concurrency_per_worker`` in flight per node.  Ids go to a node
pool and rows come back in batches (``NodePool.exchange``): per node pool
one call waits for finished tasks while at most one more carries new ids,
so the Ray calls and the driver's wake-ups are per batch, not per task.

Failures are lowwater's to count, never Ray's to hide: the actors run with
``max_restarts=0, max_task_retries=0`` (Ray would otherwise re-run a killed
actor's calls silently, with no attempt count).  An ``ActorDiedError`` or
``ActorUnavailableError`` is a node-pool crash: its tasks are re-queued at
``attempt + 1`` (after ``max_task_attempts`` the task gets one synthesized
``infra`` row, as the local pool does), and the node pool is replaced if its
node is still alive.

Options (``BackendOptions.options``): ``nodes`` (at most this many node
pools), ``actor_cpus`` (CPUs each node pool reserves from Ray's scheduler,
default 0: its processes are lowwater's), ``object_store_memory_mb`` (cap
of a local cluster's object store, default 512), ``tick_s`` (stats and memory
sampling, default 1), ``linger_s`` (how long a node pool holding a
finished task waits for others to return with it, default 0.1 s; 0 returns
each at once).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Hashable, Iterable, Iterator
from typing import Any

import attrs
import orjson
import trio

from lowwater.workers import JobSpec, PoolConfig, PoolReport, TaskInfo
from lowwater.workers.backend import BackendOptions, OnEvent, OnRows, PinBy, TaskPool, WorkerBackend
from lowwater.workers.stream import TaskAttempt

log = logging.getLogger("lowwater.ray")

MIB = 1 << 20
#: Object store cap (MiB) of a local cluster this backend starts itself.
DEFAULT_OBJECT_STORE_MB = 512
#: Ray threads kept free in each node pool for control calls (stats, unpin, stop).
CONTROL_THREADS = 4
#: Ray threads for exchanges: one waiting for rows, one carrying new ids.
EXCHANGE_THREADS = 2
#: Seconds an exchange waits for a first finished task before returning empty.
EXCHANGE_WAIT_S = 5.0
#: Default ``linger_s``: seconds a node pool holding finished tasks waits for
#: more before returning them (the tasks here run for about a second each).
DEFAULT_LINGER_S = 0.1


@attrs.define
class RayPoolReport(PoolReport):
    """:class:`~lowwater.workers.PoolReport` summed over node pools, plus:

    Attributes:
        node_pools: node pools started (replacements included).
        node_pool_crashes: node pools that died under their tasks
            (``ActorDiedError``/``ActorUnavailableError``).
        nodes: alive nodes the run used.
        tasks_per_node: tasks finished per node pool (by ``ip:pid``).
        object_store_peak_mb, object_store_used_mb: object-store bytes in
            use across nodes, highest sampled and at the end (MiB).
        shmem_peak_mb: the highest ``Shmem`` sampled on any host (MiB): the
            object store's pages stay there until the node stops.
    """

    node_pools: int = 0
    node_pool_crashes: int = 0
    nodes: int = 0
    tasks_per_node: dict[str, int] = attrs.field(factory=dict)
    object_store_peak_mb: float = 0.0
    object_store_used_mb: float = 0.0
    shmem_peak_mb: float = 0.0


def connect(address: str | None, object_store_mb: float) -> bool:
    """Join (or, with no address, start) a cluster; ``True`` when this call
    initialised Ray here (so :func:`disconnect` must undo it)."""
    import ray

    if ray.is_initialized():
        return False
    if address in (None, "", "local"):
        # "local" forces a new cluster: a bare ray.init() would join one that
        # `ray start` left on this machine.
        ray.init(
            address="local",
            include_dashboard=False,
            object_store_memory=int(object_store_mb * MIB),
            log_to_driver=False,
            configure_logging=False,
        )
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return True


def disconnect(ours: bool) -> None:
    import ray

    if ours and ray.is_initialized():
        ray.shutdown()


class RayBackend(WorkerBackend):
    """``"ray"``: one node pool per Ray node (see the module docstring)."""

    name = "ray"
    remote = True
    node_stores = True

    def pool(
        self, spec: JobSpec, config: PoolConfig, *, on_event: OnEvent | None = None, pin_by: PinBy | None = None
    ) -> TaskPool:
        return RayTaskPool(self.options, spec, config, on_event=on_event, pin_by=pin_by)

    def describe(self) -> str:
        return f"ray ({self.options.address or 'local cluster'})"


@attrs.define(eq=False)
class _Node:
    """One node pool as the driver sees it."""

    index: int
    node_id: str
    ip: str
    actor: Any = None
    pid: int | None = None
    inflight: dict[str, tuple[Any, int]] = attrs.field(factory=dict)  # task key -> (task id, attempt)
    outbox: list[tuple[Any, int]] = attrs.field(factory=list)  # assigned, not yet sent
    calls: dict[Any, tuple[bool, Any]] = attrs.field(factory=dict)  # rows ref -> (waiting, shards ref)
    waiting: bool = False  # an exchange waiting for rows is out
    sending: bool = False  # an exchange carrying ids without waiting is out
    dead: bool = False
    report: dict[str, Any] | None = None
    stats: dict[str, Any] = attrs.field(factory=dict)
    tasks: int = 0

    @property
    def label(self) -> str:
        return f"{self.ip}:{self.pid}"


class RayTaskPool:
    """The driver: spreads tasks over node pools (see the module docstring)."""

    def __init__(
        self,
        options: BackendOptions,
        spec: JobSpec,
        config: PoolConfig,
        *,
        on_event: OnEvent | None = None,
        pin_by: PinBy | None = None,
    ) -> None:
        self.options = options
        self.spec = spec
        self.config = config
        self.on_event = on_event
        self.pin_by = pin_by
        opts = options.options
        self.max_nodes = int(opts["nodes"]) if opts.get("nodes") else None
        self.actor_cpus = float(opts.get("actor_cpus", 0))
        self.object_store_mb = float(opts.get("object_store_memory_mb", DEFAULT_OBJECT_STORE_MB))
        self.tick_s = float(opts.get("tick_s", 1.0))
        self.linger_s = float(opts.get("linger_s", DEFAULT_LINGER_S))
        from lowwater.workers.backend import NODE_STORE_URL

        # Jobs uploading shards to their node's store get one task (and one
        # shards object) per exchange: see NodePool.exchange_shards.
        self.shards = spec.kwargs.get("store_url") == NODE_STORE_URL
        self.capacity = config.workers * config.concurrency_per_worker
        self._nodes: list[_Node] = []
        self._report = RayPoolReport()
        self._retries: deque[tuple[Any, int]] = deque()
        self._running = False
        self._replacing = 0

    # -- the task pool interface -------------------------------------------------------

    async def run(self, task_ids: Iterable[Any] | AsyncIterable[Any], on_rows: OnRows) -> PoolReport:
        """As :meth:`lowwater.workers.WorkerPool.run`, over the cluster's nodes.

        Raises:
            RuntimeError: already running, or no alive node.
            lowwater_ray.node_pool.PoolStopped: a node pool's workers keep
                failing to start (its ``WorkerStartError`` in the message).
        """
        if self._running:
            raise RuntimeError("this Ray task pool is already running")
        self._running = True
        self._report = RayPoolReport()
        self._on_rows = on_rows
        self._wake = trio.Event()
        started = time.perf_counter()
        ours = await trio.to_thread.run_sync(connect, self.options.address, self.object_store_mb)
        try:
            await self._start_nodes()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._sample)
                await self._dispatch(task_ids, nursery)
                nursery.cancel_scope.cancel()
            await self._stop_nodes()
        finally:
            with trio.CancelScope(shield=True):
                await self._kill_nodes()
                self._report.wall_s = round(time.perf_counter() - started, 6)
                await trio.to_thread.run_sync(disconnect, ours)
                self._running = False
        return self._report

    def stats(self) -> dict[str, Any]:
        workers: dict[str, Any] = {}
        for node in self._nodes:
            for wid, w in (node.stats.get("workers") or {}).items():
                workers[f"{node.index}:{wid}"] = {**w, "node": node.label}
        return {
            "workers": workers,
            "pool": {
                "nodes": len([n for n in self._nodes if not n.dead]),
                "in_flight": sum(len(n.inflight) for n in self._nodes),
                "retry_queue": len(self._retries),
            },
            "nodes": {n.label: {"node_id": n.node_id, "pool": n.stats.get("pool", {})} for n in self._nodes},
        }

    def unpin(self, key: Hashable) -> int:
        for node in self._nodes:
            if not node.dead and node.actor is not None:
                node.actor.unpin.remote(key)  # fire and forget: the node pool reconciles on its own loop
        return len(self._nodes)

    # -- node pools ----------------------------------------------------------------

    async def _start_nodes(self) -> None:
        from lowwater_ray.memory import alive_nodes

        nodes = await trio.to_thread.run_sync(alive_nodes)
        if self.max_nodes is not None:
            nodes = nodes[: self.max_nodes]
        if not nodes:
            raise RuntimeError("the Ray cluster has no alive node")
        per_host: dict[str, int] = {}
        for n in nodes:
            per_host[n["NodeManagerAddress"]] = per_host.get(n["NodeManagerAddress"], 0) + 1
        self._per_host = per_host
        self._report.nodes = len(nodes)
        fresh = [_Node(i, n["NodeID"], n["NodeManagerAddress"]) for i, n in enumerate(nodes)]
        async with trio.open_nursery() as nursery:
            for node in fresh:
                nursery.start_soon(self._start_node, node)
        self._nodes.extend(fresh)

    async def _start_node(self, node: _Node) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from lowwater_ray.memory import host_marks
        from lowwater_ray.node_pool import NodePool

        config = host_marks(self.config, self._per_host.get(node.ip, 1))
        actor_class = ray.remote(NodePool).options(
            # Failures are counted by lowwater, never retried silently by Ray.
            max_restarts=0,
            max_task_retries=0,
            max_concurrency=EXCHANGE_THREADS + CONTROL_THREADS,
            num_cpus=self.actor_cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            name=None,
        )
        node.actor = actor_class.remote(self.spec, config, self.pin_by)
        info: dict[str, Any] = await trio.to_thread.run_sync(_get, node.actor.ready.remote())
        node.pid = info["pid"]
        self._report.node_pools += 1
        self._emit("node_pool_ready", node=node.label, node_id=node.node_id)

    async def _replace(self, dead: _Node) -> None:
        """A new node pool on ``dead``'s node, if the node is alive (a task of its own:
        a start takes seconds, and the other nodes' completions must not wait)."""
        from lowwater_ray.memory import alive_nodes

        self._replacing += 1
        try:
            alive = {n["NodeID"] for n in await trio.to_thread.run_sync(alive_nodes)}
            if dead.node_id not in alive:
                log.warning("node %s is gone: its node pool is not replaced", dead.ip)
                return
            node = _Node(max(n.index for n in self._nodes) + 1, dead.node_id, dead.ip)
            try:
                await self._start_node(node)
            except Exception as exc:
                log.error("replacing the node pool on %s failed: %r", dead.ip, exc)
                return
            self._nodes.append(node)
        finally:
            self._replacing -= 1
            self._notify()

    async def _stop_nodes(self) -> None:
        import ray

        async def stop(node: _Node) -> None:
            try:
                node.report = await trio.to_thread.run_sync(ray.get, node.actor.stop.remote())
            except Exception as exc:  # a node pool dying at the end: its report is lost, not the run
                log.warning("node pool %s did not report: %r", node.label, exc)

        async with trio.open_nursery() as nursery:
            for node in self._nodes:
                if not node.dead:
                    nursery.start_soon(stop, node)
        for node in self._nodes:
            self._merge(node.report)

    async def _kill_nodes(self) -> None:
        import ray

        for node in self._nodes:
            if node.actor is not None:
                try:
                    await trio.to_thread.run_sync(ray.kill, node.actor)
                except Exception:
                    pass
                node.actor = None
        self._report.tasks_per_node = {n.label: n.tasks for n in self._nodes}

    def _merge(self, report: dict[str, Any] | None) -> None:
        if not report:
            return
        r = self._report
        for key in (
            "admission_holds",
            "admission_forced",
            "recycled_by_count",
            "recycled_by_rss",
            "replaced_after_crash",
            "replaced_after_heartbeat_timeout",
            "retried_tasks",
            "failed_tasks",
            "start_failures",
            "workers_started",
            "max_workers_alive",
        ):
            setattr(r, key, getattr(r, key) + int(report.get(key) or 0))
        r.admission_wait_s = round(r.admission_wait_s + float(report.get("admission_wait_s") or 0), 6)
        r.worker_rss_peak_mb = max(r.worker_rss_peak_mb, float(report.get("worker_rss_peak_mb") or 0))
        r.pool_rss_peak_mb = max(r.pool_rss_peak_mb, float(report.get("pool_rss_peak_mb") or 0))
        r.memory_limit_mb = max(r.memory_limit_mb, float(report.get("memory_limit_mb") or 0))
        r.memory_limit_source = str(report.get("memory_limit_source") or r.memory_limit_source)
        for key, count in (report.get("leftovers") or {}).items():
            r.leftovers[key] = r.leftovers.get(key, 0) + int(count)

    # -- dispatch ----------------------------------------------------------------------

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    def _free(self) -> _Node | None:
        live = [n for n in self._nodes if not n.dead and n.actor is not None and len(n.inflight) < self.capacity]
        return min(live, key=lambda n: (len(n.inflight), n.index)) if live else None

    async def _dispatch(self, task_ids: Iterable[Any] | AsyncIterable[Any], nursery: trio.Nursery) -> None:
        source = self._source = _Source(task_ids, self._notify)
        self._completions = waiter = _Completions(self)
        nursery.start_soon(waiter.run)
        nursery.start_soon(source.feed)
        while True:
            if source.exhausted and not self._retries and not any(n.inflight for n in self._nodes):
                return
            if not any(not n.dead for n in self._nodes) and not self._replacing:
                raise RuntimeError("every Ray node pool died and none could be replaced")
            self._pump()
            await self._wait(self.tick_s)

    def _pump(self) -> None:
        """Assign ids (re-runs first) to the node pools with room, then send
        them: with a waiting exchange if the node pool has none out, else
        with a non-waiting one if none is out (else they wait for the next)."""
        while (node := self._free()) is not None:
            if self._retries:
                task_id, attempt = self._retries.popleft()
            else:
                item = self._source.take()
                if item is _WAIT or item is _END:
                    break
                task_id, attempt = item
            node.inflight[orjson.dumps(task_id).decode()] = (task_id, attempt)
            node.outbox.append((task_id, attempt))
            self._emit("dispatch", node=node.label, task_id=task_id, attempt=attempt)
        for node in self._nodes:
            if node.dead or node.actor is None:
                continue
            if node.inflight and not node.waiting:
                self._call(node, True)
            elif node.outbox and not node.sending:
                self._call(node, False)

    def _call(self, node: _Node, waiting: bool) -> None:
        # A function of its own: no long-lived frame may keep a step's object
        # reference (the last group's would outlive its clear_batch).
        tasks, node.outbox = node.outbox, []
        wait_s = EXCHANGE_WAIT_S if waiting else 0.0
        if self.shards:
            rows_ref, shards_ref = node.actor.exchange_shards.remote(tasks, wait_s, self.linger_s)
        else:
            rows_ref, shards_ref = node.actor.exchange.remote(tasks, wait_s, self.linger_s, self.capacity), None
        node.calls[rows_ref] = (waiting, shards_ref)
        if waiting:
            node.waiting = True
        else:
            node.sending = True
        self._completions.wake()

    async def _wait(self, timeout: float) -> None:
        wake = self._wake
        with trio.move_on_after(timeout):
            await wake.wait()

    async def _complete(self, node: _Node, rows_ref: Any, outcome: Any) -> None:
        """An exchange returned: deliver its rows, or handle its node pool's death."""
        import ray

        call = node.calls.pop(rows_ref, None)
        if call is None or node.dead:  # a dead node pool's tasks are re-queued already
            return
        waiting, shards_ref = call
        if waiting:
            node.waiting = False
        else:
            node.sending = False
        if isinstance(outcome, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)):
            await self._node_died(node, outcome)
            return
        if isinstance(outcome, BaseException):
            raise outcome
        from lowwater_ray.transport import shard_refs

        for key, attempt, pid, worker, status, rows in orjson.loads(outcome):
            entry = node.inflight.pop(key, None)
            if entry is None:  # cannot happen: a node pool returns what it was given
                log.error("node pool %s returned rows of task %s it was not running", node.label, key)
                continue
            task_id = entry[0]
            if shards_ref is not None:
                shard_refs(rows, shards_ref, f"ray:{node.ip}")
            node.tasks += 1
            self._report.tasks += 1
            self._report.rows += len(rows)
            await self._on_rows(rows, TaskInfo(task_id, attempt, attempt > 1, pid, worker, status))
        del shards_ref
        self._notify()

    async def _node_died(self, node: _Node, error: BaseException) -> None:
        if node.dead:
            return
        node.dead = True
        self._report.node_pool_crashes += 1
        lost = list(node.inflight.values())
        node.inflight.clear()
        node.outbox.clear()
        node.calls.clear()
        log.error("node pool %s died with %d task(s) in flight: %s", node.label, len(lost), type(error).__name__)
        self._emit("node_pool_died", node=node.label, tasks=len(lost))
        for task_id, attempt in lost:
            if attempt < self.config.max_task_attempts:
                self._retries.append((task_id, attempt + 1))
                self._report.retried_tasks += 1
                continue
            self._report.failed_tasks += 1
            row = {
                "task_id": task_id,
                "attempt": attempt,
                "error": {
                    "class": "infra",
                    "message": f"node pool died while running this task ({type(error).__name__}; node {node.label}); "
                    f"gave up after {attempt} attempt{'s' if attempt > 1 else ''}",
                },
                "worker_pid": node.pid,
            }
            self._report.tasks += 1
            self._report.rows += 1
            await self._on_rows([row], TaskInfo(task_id, attempt, attempt > 1, node.pid, -1, "failed"))
        try:
            import ray

            ray.kill(node.actor)  # unavailable may not mean dead: make sure nothing of it runs on
        except Exception:
            pass
        self._nursery.start_soon(self._replace, node)
        self._notify()

    # -- stats and memory ----------------------------------------------------------------

    async def _sample(self) -> None:
        import ray

        from lowwater_ray.memory import object_store, shmem_bytes

        while True:
            for node in list(self._nodes):
                if node.dead or node.actor is None:
                    continue
                try:
                    with trio.move_on_after(max(self.tick_s, 5.0)):
                        node.stats = await trio.to_thread.run_sync(ray.get, node.actor.stats.remote())
                except Exception:
                    pass  # a dying node pool: its death is handled where its tasks fail
            stores = await trio.to_thread.run_sync(object_store)
            used = sum(s["used_bytes"] for s in stores.values())
            shmem = max([shmem_bytes()] + [int(n.stats.get("shmem_bytes") or 0) for n in self._nodes])
            r = self._report
            r.object_store_used_mb = round(used / MIB, 2)
            r.object_store_peak_mb = max(r.object_store_peak_mb, r.object_store_used_mb)
            r.shmem_peak_mb = max(r.shmem_peak_mb, round(shmem / MIB, 2))
            await trio.sleep(self.tick_s)

    def _emit(self, name: str, **fields: Any) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(name, fields)
        except Exception:
            log.exception("on_event(%r) raised", name)


_WAIT: Any = object()
_END: Any = object()


class _Source:
    """Task ids pulled one at a time, only when a node pool has room: from
    an iterable at once, from an async iterable (a ``TaskStream``) by a
    feeder task that pulls one id on demand and wakes the dispatcher."""

    def __init__(self, task_ids: Iterable[Any] | AsyncIterable[Any], notify: Callable[[], None]) -> None:
        self.exhausted = False
        self._notify = notify
        self._aiter: AsyncIterator[Any] | None = None
        self._iter: Iterator[Any] | None = None
        if isinstance(task_ids, AsyncIterable):
            self._aiter = task_ids.__aiter__()
        else:
            self._iter = iter(task_ids)
        self._item: Any = _WAIT
        self._wanted = trio.Event()

    def take(self) -> Any:
        """``(task_id, attempt)``, :data:`_WAIT` (asked for; not here yet) or :data:`_END`."""
        if self.exhausted:
            return _END
        if self._iter is not None:
            item = next(self._iter, _END)
        else:
            item = self._item
            if item is _WAIT:
                self._wanted.set()
                return _WAIT
            if item is not _END:
                self._item = _WAIT
        if item is _END:
            self.exhausted = True
            return _END
        if isinstance(item, TaskAttempt):
            return item.task_id, item.attempt
        return item, 1

    async def feed(self) -> None:
        """The feeder (async sources only): one ``anext`` per request."""
        if self._aiter is None:
            return
        while self._item is not _END:
            await self._wanted.wait()
            self._wanted = trio.Event()
            if self._item is _WAIT:
                try:
                    self._item = await anext(self._aiter)
                except StopAsyncIteration:
                    self._item = _END
                self._notify()


class _Completions:
    """Waits (in a thread, ``ray.wait``) for the exchanges out, hands each
    returned one to the pool, then sends what the freed room lets in before
    waiting again (so the next exchange is watched at once)."""

    def __init__(self, pool: RayTaskPool) -> None:
        self.pool = pool
        self._more = trio.Event()

    def wake(self) -> None:
        self._more.set()

    async def run(self) -> None:
        while True:
            calls = {ref: node for node in self.pool._nodes for ref in node.calls}
            if not calls:
                self._more = trio.Event()
                await self._more.wait()
                continue
            for ref, outcome in await trio.to_thread.run_sync(_wait_and_get, list(calls)):
                await self.pool._complete(calls[ref], ref, outcome)
            del calls
            self.pool._pump()


def _get(ref: Any) -> Any:
    """``ray.get`` of one reference (its overloads type a call through
    ``trio.to_thread.run_sync`` as the list variant's)."""
    import ray

    return ray.get(ref)


def _wait_and_get(refs: list[Any]) -> list[tuple[Any, Any]]:
    """In a thread: wait up to 0.2 s for one of ``refs``, then take every
    ready one; each with its value or the exception ``ray.get`` raised.  The
    bound keeps calls submitted meanwhile from waiting long to be watched."""
    import ray

    ready, rest = ray.wait(refs, num_returns=1, timeout=0.2, fetch_local=False)
    if ready and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=False)
        ready += more
    out = []
    for ref in ready:
        try:
            out.append((ref, ray.get(ref)))
        except Exception as exc:  # delivered as the call's outcome
            out.append((ref, exc))
    return out


__all__ = ["RayBackend", "RayPoolReport", "RayTaskPool", "connect", "disconnect"]
