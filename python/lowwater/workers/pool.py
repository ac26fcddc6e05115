"""The env worker pool: N worker processes, each a Trio loop serving many
tasks of one job, that recycle, admit by memory, heartbeat and recover.

Why it looks like this (docs/design.md#incidents, the 30-worker evaluation
incident: OOM-killed after five hours under 8 GiB): the peers' workers never
recycled, so RSS crept up; their fix then OOM-killed jobs at start, because
freshly *spawned* replacements lost copy-on-write sharing and all restarted
at once.  Here:

* workers come from a lean forkserver (only this package, trio, orjson,
  psutil, attrs preloaded; none of the parent's ``__main__``), so a start is
  a ``fork()`` of a small interpreter and its pages are shared;
* a worker retires after a jittered task count or when its *current* RSS
  passes a jittered limit; it drains its in-flight tasks, its replacement is
  started and ready before it is told to exit, and at most one worker is
  ever extra (``workers + 1`` processes at most);
* new tasks wait while a worker, or the pool against the machine/cgroup
  limit, is above its high-water mark, until back under the low-water mark;
* heartbeats catch hung workers; a dead or hung worker is replaced and its
  in-flight task ids are re-run, so every task gets exactly one row;
* the parent keeps in-flight task ids and attempt counts only, never payloads
  or results: rows are handed to ``on_rows`` and dropped.

The pieces: :mod:`~lowwater.workers.contract` (the job, ``TaskInfo``,
``PoolReport``, errors), :mod:`~lowwater.workers.config` (``PoolConfig``),
:mod:`~lowwater.workers.launcher` (the lean forkserver launcher),
:mod:`~lowwater.workers.record` (the parent's record of a worker),
:mod:`~lowwater.workers.supervision` (the worker half of the pool); this
module runs a job's tasks: dispatch, delivery and stopping.  It stays one
module of ~600 lines because dispatch, re-runs after a crash and the drain
at stop share the in-flight table, whose every change must keep "exactly one
row per task".
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Hashable, Iterable, Iterator
from typing import Any

import attrs
import psutil
import trio

from lowwater.workers import allocator as allocator_mod
from lowwater.workers.admission import MIB, PoolAdmission, memory_limit_bytes
from lowwater.workers.backend import OnEvent, OnRows, PinBy
from lowwater.workers.config import PoolConfig
from lowwater.workers.contract import (
    JobSpec,
    PoolReport,
    TaskInfo,
)
from lowwater.workers.launcher import check_python, configure_forkserver
from lowwater.workers.protocol import encode
from lowwater.workers.record import WorkerRecord, WorkerState
from lowwater.workers.stream import TaskAttempt
from lowwater.workers.supervision import WorkerSupervision

log = logging.getLogger("lowwater.workers")


class WorkerPool(WorkerSupervision):
    """Run a job's tasks in ``config.workers`` processes; see the module docstring.

    Args:
        spec: the job, built in each worker.
        config: the pool's settings (:class:`~lowwater.workers.config.PoolConfig`);
            ``None``: built from ``kwargs``.
        on_event: ``on_event(name, fields)`` for observability and tests;
            called synchronously on the pool's loop; must not block.  Names:
            ``started``, ``ready``, ``dispatch``, ``retiring``, ``exit_sent``,
            ``killed``, ``reaped``, ``worker_held``, ``worker_released``,
            ``pool_held``, ``pool_released``, ``retry``, ``failed``.
        pin_by: ``pin_by(task_id)`` names what a finished task's worker must
            outlive (a trainer step whose shards it produced), or ``None``;
            a retiring worker holding such a pin does not exit until
            :meth:`unpin` releases it (the run's end releases everything).
        **kwargs: :class:`PoolConfig` fields (``workers=4, max_rss_mb=...``);
            with ``config``, they override its values.

    Raises:
        PoolConfigError: a setting out of range (a ``ValueError``).
        ValueError: an allocator value in the environment is not an integer.
        TypeError: an unknown keyword argument, or no ``workers``.
    """

    def __init__(
        self,
        spec: JobSpec,
        config: PoolConfig | None = None,
        *,
        on_event: OnEvent | None = None,
        pin_by: PinBy | None = None,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = PoolConfig(**kwargs)
        elif kwargs:
            config = attrs.evolve(config, **kwargs)
        self.spec = spec
        self.config = config
        self.on_event = on_event
        self.pin_by = pin_by
        self._pins: dict[int, set[Hashable]] = {}
        self._feeder: _Feeder | None = None
        self.allocator = (
            allocator_mod.resolve(config.malloc_arena_max, config.malloc_trim_threshold)
            if config.allocator_hygiene
            else None
        )
        if config.memory_limit_mb is not None:
            limit, source = int(config.memory_limit_mb * MIB), "argument"
        else:
            limit, source = memory_limit_bytes()
        self.memory_limit_source = source
        self._limit_bytes = limit
        self.admission = self._new_admission()
        self._rng = random.Random(config.seed)
        self._running = False
        self._failure: BaseException | None = None
        self._main_scope: trio.CancelScope | None = None
        self._workers: list[WorkerRecord] = []
        self._next_wid = 0

    # -- public ---------------------------------------------------------------

    async def run(
        self,
        task_ids: Iterable[Any] | AsyncIterable[Any],
        on_rows: OnRows,
    ) -> PoolReport:
        """Run every task of ``task_ids`` once and hand its rows to ``on_rows``.

        Task ids must be JSON scalars (str or int) or other JSON-able values;
        they are pulled lazily, only when a worker slot is free and admission
        allows.  ``task_ids`` may be an async iterable (a
        :class:`~lowwater.workers.stream.TaskStream` fed over time): the pool
        then serves until it ends, keeping its workers between ids.  An item
        that is a :class:`~lowwater.workers.stream.TaskAttempt` runs at that
        attempt.  ``on_rows(rows, info)`` is awaited once per task, one call
        at a time, in completion order; exactly one call per task id
        (re-runs after a worker death are flagged ``info.retried``).
        Workers are started on entry and stopped before return.

        On cancellation, workers are told to cancel their in-flight tasks;
        the rows they send within ``cancel_grace_s`` are still delivered
        (tasks without an answer get no row and can be re-run from their
        ids); then every worker is stopped and reaped, and ``Cancelled``
        propagates.

        Raises:
            RuntimeError: the pool is already running, or (forkserver
                start method) this Python is not one the lean launcher was
                checked on (:data:`lowwater.workers.launcher.SUPPORTED_PYTHON`).
            WorkerStartError: workers keep failing to start.
            PoolConfigError: a fresh worker already exceeds ``max_rss_mb``
                or ``high_water_mb``.
            TypeError: a task id is not JSON-serialisable.
            Exception: whatever ``on_rows`` or the iterable raised.
        """
        if self._running:
            raise RuntimeError("this WorkerPool is already running")
        if self.config.start_method == "forkserver":
            check_python()  # workers start through a copy of a private CPython method
        self._running = True
        self._reset()
        self._on_rows = on_rows
        started = time.perf_counter()
        # Peek one id so an empty run (a resumed eval with nothing left)
        # starts no worker; every later id is pulled only when a slot is free.
        tasks: Iterator[Any]
        if isinstance(task_ids, AsyncIterable):
            feeder = _Feeder(aiter(task_ids), self._notify)
            try:
                empty = not await feeder.peek()
            except BaseException:
                self._running = False
                raise
            if empty:
                self._running = False
                return self._finish_report()
            self._feeder, tasks = feeder, iter(())
        else:
            it = iter(task_ids)
            try:
                first = next(it)
            except StopIteration:
                self._running = False
                return self._finish_report()
            tasks = itertools.chain([first], it)
        configure_forkserver(self.config.preload)
        interrupted = False
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._service(self._supervise)
                self._service(self._deliver)
                if self._feeder is not None:
                    self._service(self._feeder.run)
                clean = False
                try:
                    with trio.CancelScope() as self._main_scope:
                        await self._dispatch(tasks)
                        await self._stop_gracefully()
                        clean = True
                except trio.Cancelled:
                    self._report.cancelled = True
                    raise
                except BaseException as exc:
                    # Kept and re-raised after the nursery, so callers see the
                    # iterable's or on_rows's own exception, not a group.
                    self._report.cancelled = isinstance(exc, KeyboardInterrupt)
                    if self._failure is None:
                        self._failure = exc
                finally:
                    with trio.CancelScope(shield=True):
                        if not clean:
                            await self._abort()
                        await self._kill_all()
                    for scope in list(self._service_scopes):
                        scope.cancel()
        # A strict Trio nursery raises groups only.  Ctrl-C anywhere in the
        # group wins and is re-raised bare, as the CLI expects it; what came
        # with it (Cancelled of an outside cancellation, say) is dropped, or
        # it would wrap the KeyboardInterrupt again.
        except* KeyboardInterrupt:
            interrupted = True
        except* BaseException:
            if not interrupted:
                raise
        finally:
            self._running = False
            self._feeder = None
            self._pins.clear()
            self._report.wall_s = round(time.perf_counter() - started, 6)
        if interrupted:
            raise KeyboardInterrupt from None
        if self._failure is not None:
            raise self._failure
        return self._finish_report()

    def stats(self) -> dict[str, Any]:
        """Live stats: per worker (latest heartbeat) and for the pool.

        ``{"workers": {wid: {...}}, "pool": {...}}``; RSS in MiB, lag in ms,
        ``heartbeat_age_s`` since the worker was last heard from.
        """
        now = time.monotonic()
        workers = {}
        for w in self._workers:
            workers[w.wid] = {
                "pid": w.pid,
                "state": w.state.value,
                "rss_mb": round(w.rss / MIB, 2),
                "in_flight": len(w.pending),
                "dispatched": w.dispatched,
                "completed": w.completed,
                "max_tasks": w.max_tasks,
                "max_rss_mb": None if w.max_rss is None else round(w.max_rss / MIB, 2),
                "held": self.admission.worker_held(w.wid),
                "pinned": sorted(map(str, self._pins.get(w.wid, ()))),
                "idle": bool(w.hb.get("idle")) and not w.pending,
                "settled": w.settled,
                "lag_p50_ms": w.hb.get("lag_p50_ms"),
                "lag_p99_ms": w.hb.get("lag_p99_ms"),
                "job": w.hb.get("job", {}),
                "heartbeat_age_s": round(now - w.last_seen, 3) if w.last_seen else None,
                "allocator": w.allocator,
            }
        return {
            "workers": workers,
            "pool": {
                "alive": self._alive,
                "rss_mb": round(self.admission.pool_bytes / MIB, 2),
                "held": self.admission.pool.held,
                "limit_mb": round(self.admission.limit_bytes / MIB, 2),
                "retry_queue": len(self._retries),
                "undelivered": self._backlog,
            },
        }

    def unpin(self, key: Hashable) -> int:
        """Release ``key`` (see ``pin_by``) on every worker; a retiree left
        without pins and without tasks exits (its replacement is ready).

        Returns how many workers held it.
        """
        held = 0
        for wid in list(self._pins):
            keys = self._pins[wid]
            if key in keys:
                keys.discard(key)
                held += 1
            if not keys:
                del self._pins[wid]
        if held and self._running:
            self._reconcile()
        return held

    def _pin(self, w: WorkerRecord, task_id: Any) -> None:
        """Called as ``w`` delivers ``task_id``'s result: pin it if ``pin_by`` says so."""
        if self.pin_by is None:
            return
        key = self.pin_by(task_id)
        if key is not None:
            self._pins.setdefault(w.wid, set()).add(key)

    def _pinned(self, w: WorkerRecord) -> bool:
        return bool(self._pins.get(w.wid))

    # -- run state --------------------------------------------------------------

    def _reset(self) -> None:
        self.admission = self._new_admission()
        self._report = PoolReport(
            memory_limit_mb=round(self.admission.limit_bytes / MIB, 2), memory_limit_source=self.memory_limit_source
        )
        self._workers = []
        self._alive = 0
        self._retries: deque[tuple[Any, int]] = deque()
        self._exhausted = False
        self._closing = False
        self._backlog = 0
        self._seq = 0
        self._consecutive_start_failures = 0
        self._last_fatal: str | None = None
        self._failure = None
        self._service_scopes: set[trio.CancelScope] = set()
        self._main_scope = None
        self._wake = trio.Event()
        self._parent_rss = psutil.Process().memory_info().rss
        self._deliver_send, self._deliver_recv = trio.open_memory_channel[tuple[list[dict[str, Any]], TaskInfo]](
            math.inf
        )
        self._start_lock = trio.Lock()

    def _new_admission(self) -> PoolAdmission:
        c = self.config
        return PoolAdmission(
            worker_high_bytes=None if c.high_water_mb is None else c.high_water_mb * MIB,
            worker_low_bytes=None if c.low_water_mb is None else c.low_water_mb * MIB,
            limit_bytes=self._limit_bytes,
            pool_high_fraction=c.pool_high_water_fraction,
            pool_low_fraction=c.pool_low_water_fraction,
        )

    def _finish_report(self) -> PoolReport:
        r = self._report
        r.admission_holds = self.admission.worker_holds + self.admission.pool.holds
        r.admission_wait_s = round(r.admission_wait_s, 6)
        return r

    def _emit(self, name: str, w: WorkerRecord | None = None, **fields: Any) -> None:
        if self.on_event is None:
            return
        if w is not None:
            fields = {"wid": w.wid, "pid": w.pid, **fields}
        try:
            self.on_event(name, fields)
        except Exception:  # an observer must not corrupt the pool's state
            log.exception("on_event(%r) raised", name)

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    async def _changed(self, timeout: float | None = None) -> None:
        """Wait for the next state change (or ``timeout`` seconds)."""
        wake = self._wake
        if timeout is None:
            await wake.wait()
        else:
            with trio.move_on_after(timeout):
                await wake.wait()

    def _service(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Start a background task that outside cancellation cannot reach
        (readers must keep reading while a cancelled run collects rows);
        it ends when its scope is cancelled at the end of :meth:`run`."""
        scope = trio.CancelScope(shield=True)
        self._service_scopes.add(scope)
        self._nursery.start_soon(self._run_service, scope, fn, *args)

    # KI-protected: Ctrl-C is then raised in the task awaiting run() (at its
    # next checkpoint), which cancels tasks and collects their rows, never
    # in the middle of a reader's or the deliverer's bookkeeping.
    @trio.lowlevel.enable_ki_protection
    async def _run_service(self, scope: trio.CancelScope, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            with scope:
                await fn(*args)
        except Exception as exc:
            self._fail(exc)
        finally:
            self._service_scopes.discard(scope)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._closing = True  # start nothing new, re-run nothing
        if self._main_scope is not None:
            self._main_scope.cancel()

    # -- counting ---------------------------------------------------------------

    def _in_flight(self) -> int:
        return sum(len(w.pending) for w in self._workers)

    def _active(self) -> int:
        return sum(w.state.serving for w in self._workers)

    def _need_workers(self) -> bool:
        return not self._exhausted or bool(self._retries)

    # -- dispatch ---------------------------------------------------------------

    def _slots(self, ignore_memory: bool) -> list[WorkerRecord]:
        return [
            w
            for w in self._workers
            if w.state is WorkerState.READY
            and len(w.pending) < self.config.concurrency_per_worker
            and (ignore_memory or not self.admission.worker_held(w.wid))
        ]

    def _pick(self) -> tuple[WorkerRecord | None, bool, bool]:
        """A worker to run the next task on, whether memory held one back,
        and whether admission is being forced (see :meth:`_may_force`)."""
        if self._backlog >= self.config.workers * self.config.concurrency_per_worker:
            return None, False, False  # on_rows is behind: do not pile up rows in the parent
        if not self._slots(ignore_memory=True):
            return None, False, False
        admitted = self._slots(ignore_memory=False)
        forced = False
        if admitted and self.admission.pool.held:
            forced = self._may_force()
            if not forced:
                admitted = []
        if not admitted:
            return None, True, False
        return min(admitted, key=lambda w: (len(w.pending), w.wid)), False, forced

    def _may_force(self) -> bool:
        """The pool is over its high-water mark with nothing in flight and
        every worker idle and trimmed: waiting cannot bring it down, so admit
        one task at a time rather than deadlock."""
        if self._in_flight() or any(w.state is WorkerState.STARTING for w in self._workers):
            return False
        return all(w.settled for w in self._workers if w.state is WorkerState.READY)

    def _next_task(self, it: Iterator[Any]) -> tuple[Any, int] | None:
        if self._retries:
            return self._retries.popleft()
        if self._exhausted:
            return None
        if self._feeder is not None:
            item = self._feeder.take()
            if item is _PENDING:
                return None  # asked for; the feeder wakes the dispatcher when it arrives
        else:
            item = next(it, _END)
        if item is _END:
            self._exhausted = True
            self._reconcile()
            return None
        if isinstance(item, TaskAttempt):
            return item.task_id, item.attempt
        return item, 1

    def _finished(self) -> bool:
        return self._exhausted and not self._retries and self._in_flight() == 0 and self._backlog == 0

    async def _dispatch(self, it: Iterator[Any]) -> None:
        self._reconcile()
        held_since: float | None = None
        while True:
            if self._finished():
                if held_since is not None:
                    self._report.admission_wait_s += time.monotonic() - held_since
                break
            w, held, forced = self._pick()
            now = time.monotonic()
            if held and self._need_workers():
                held_since = now if held_since is None else held_since
            elif held_since is not None:
                self._report.admission_wait_s += now - held_since
                held_since = None
            if w is None:
                await self._changed(timeout=self.config.heartbeat_s)
                continue
            task = self._next_task(it)
            if task is None:
                await self._changed(timeout=self.config.heartbeat_s)
                continue
            task_id, attempt = task
            if forced:
                self._report.admission_forced += 1
                log.warning(
                    "pool RSS %.0f MiB stays above its low-water mark with nothing in flight; admitting one task",
                    self.admission.pool_bytes / MIB,
                )
            self._seq += 1
            frame = encode({"op": "run", "seq": self._seq, "task_id": task_id, "attempt": attempt})
            w.pending[self._seq] = (task_id, attempt)
            w.dispatched += 1
            w.settled = False
            w.outbox.send_nowait(frame)
            self._emit("dispatch", w, task_id=task_id, attempt=attempt)
            self._reconcile()
            await trio.lowlevel.checkpoint()

    async def _deliver(self) -> None:
        async for rows, info in self._deliver_recv:
            await self._on_rows(rows, info)
            del rows
            self._backlog -= 1
            self._report.tasks += 1
            self._notify()

    def _push(self, rows: list[dict[str, Any]], info: TaskInfo) -> None:
        self._backlog += 1
        self._report.rows += len(rows)
        self._deliver_send.send_nowait((rows, info))

    # -- stopping -----------------------------------------------------------------

    async def _stop_gracefully(self) -> None:
        """Every task has its rows: tell every worker to exit and reap them."""
        self._closing = True
        for w in list(self._workers):
            if w.state.running:
                self._send_exit(w, "stop")
        while self._alive:
            await self._changed(timeout=1.0)

    @trio.lowlevel.enable_ki_protection  # a second Ctrl-C must not cut the clean-up short
    async def _abort(self) -> None:
        """Cancel in-flight tasks, collect their rows for up to
        ``cancel_grace_s``, then tell workers to exit (shielded by the caller)."""
        self._closing = True
        for w in self._workers:
            if w.outbox is not None and w.pending:
                w.outbox.send_nowait(encode({"op": "cancel"}))
        with trio.move_on_after(self.config.cancel_grace_s):
            while self._in_flight() or (self._backlog and self._failure is None):
                await self._changed(timeout=0.5)
        for w in list(self._workers):
            if w.state.running:
                self._send_exit(w, "stop")
        with trio.move_on_after(min(self.config.exit_timeout_s, self.config.cancel_grace_s)):
            while self._alive:
                await self._changed(timeout=0.5)

    @trio.lowlevel.enable_ki_protection
    async def _kill_all(self) -> None:
        """Leave no process behind: SIGKILL whatever is alive and wait for reaping."""
        self._closing = True
        for w in list(self._workers):
            if w.process is not None and w.state is not WorkerState.REAPED:
                self._kill(w, w.death or "shutdown")
        with trio.move_on_after(30.0):
            while self._alive:
                await self._changed(timeout=0.5)
        if self._alive:
            log.error("%d worker processes could not be reaped", self._alive)


_PENDING: Any = object()
_END: Any = object()


class _Feeder:
    """Pulls an async task source one id at a time, only when the
    dispatcher asks (:meth:`take` found nothing), so an async source is as
    lazy as a plain iterable: at most one id waits here."""

    def __init__(self, source: AsyncIterator[Any], notify: Callable[[], None]) -> None:
        self._source = source
        self._notify = notify
        self._item: Any = _PENDING
        self._wanted = trio.Event()

    async def peek(self) -> bool:
        """Pull the first id; ``False`` if the source is empty."""
        self._item = await self._pull()
        return self._item is not _END

    async def _pull(self) -> Any:
        try:
            return await anext(self._source)
        except StopAsyncIteration:
            return _END

    def take(self) -> Any:
        """The pulled id, :data:`_END`, or :data:`_PENDING` (and ask for one)."""
        item = self._item
        if item is _PENDING:
            self._wanted.set()
        elif item is not _END:
            self._item = _PENDING
        return item

    async def run(self) -> None:
        while self._item is not _END:
            await self._wanted.wait()
            self._wanted = trio.Event()
            if self._item is _PENDING:
                self._item = await self._pull()
                self._notify()


__all__ = ["WorkerPool"]
