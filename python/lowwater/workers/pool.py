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
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import multiprocessing
import os
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from typing import Any

import attrs
import psutil
import trio

from lowwater.workers import allocator as allocator_mod
from lowwater.workers import child as child_mod
from lowwater.workers.admission import MIB, PoolAdmission, memory_limit_bytes
from lowwater.workers.protocol import FramedStream, ProtocolError, encode

log = logging.getLogger("lowwater.workers")

#: Modules the forkserver imports once; every worker shares their pages.
#: Lean on purpose: a worker imports its job's dependencies itself.
LEAN_PRELOAD = ("lowwater.workers.child", "lowwater.workers.pool")


# --- the contract --------------------------------------------------------------


@attrs.frozen
class JobSpec:
    """A picklable, JSON-able description of a job, built in each worker.

    Attributes:
        factory: ``"package.module:callable"``, imported in the worker;
            ``callable(**kwargs)`` returns a :class:`WorkerJob`.  It must be
            importable by module name (not defined in ``__main__``: workers
            do not import the parent's main module).
        kwargs: JSON-able keyword arguments for the factory.

    Raises:
        ValueError: ``factory`` is not of the form ``module:callable``.
    """

    factory: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"factory must be 'module:callable', not {self.factory!r}")


class WorkerJob:
    """Base class of the job a worker runs; subclass and name a factory in a :class:`JobSpec`.

    All methods run in the worker process, on its Trio loop.
    ``setup()`` and ``teardown()`` run in the same task around the serving
    loop, but ``teardown()`` runs inside its own (shielded, deadline-bound)
    cancel scope: a nursery or cancel scope that ``setup`` entered (say
    through an ``AsyncExitStack``) must not be exited by ``teardown``, or
    Trio's scope stack is corrupted.  Hold such contexts open in a service
    task instead: ``self.nursery`` is set before ``setup()``, a nursery for
    background services (an interception server, a model client),
    cancelled after ``teardown()``; :class:`lowwater.eval.job.EvalJob`
    shows the pattern.
    """

    nursery: trio.Nursery

    async def setup(self) -> None:
        """Once per worker process, before the first task."""

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        """Run one task and return its result rows (JSON-serialisable dicts).

        ``attempt`` starts at 1 and grows when a task is re-run after its
        worker died.  An exception becomes one error row (class ``infra``);
        on cancellation (pool shutdown) the worker sends one row with error
        class ``cancelled``, unless ``run`` catches the cancellation and
        returns its own rows.
        """
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Extra heartbeat stats (table stats...): cheap, non-blocking, JSON-able."""
        return {}

    async def tick(self, stats: dict[str, Any]) -> None:
        """Called on the heartbeat cadence in its own task (fire ``worker_tick`` here).

        ``stats`` has ``rss_bytes``, ``in_flight`` and ``finished``.
        """

    async def teardown(self) -> None:
        """Once, when the worker stops (under ``teardown_timeout_s``)."""


@attrs.frozen
class TaskInfo:
    """What ``on_rows`` is told about a finished task.

    Attributes:
        task_id: the id as it came from the iterable.
        attempt: 1 for a first run; higher after re-runs.
        retried: ``attempt > 1``: an earlier worker died running it.
        pid: the worker's pid (``None`` when the row was synthesized before
            any worker ran it).
        worker: the worker's index in this pool (``-1`` if none).
        status: ``"ok"``, ``"error"`` (the job raised), ``"cancelled"``
            (shutdown), or ``"failed"`` (the pool synthesized an infra row
            after ``max_task_attempts`` worker deaths).
    """

    task_id: Any
    attempt: int
    retried: bool
    pid: int | None
    worker: int
    status: str


@attrs.define
class PoolReport:
    """What :meth:`WorkerPool.run` returns (counts are per run; ``_s``
    seconds, ``_mb`` MiB of current RSS)."""

    tasks: int = 0
    rows: int = 0
    admission_wait_s: float = 0.0
    admission_holds: int = 0
    admission_forced: int = 0
    recycled_by_count: int = 0
    recycled_by_rss: int = 0
    replaced_after_crash: int = 0
    replaced_after_heartbeat_timeout: int = 0
    retried_tasks: int = 0
    failed_tasks: int = 0
    start_failures: int = 0
    workers_started: int = 0
    max_workers_alive: int = 0
    worker_rss_peak_mb: float = 0.0
    pool_rss_peak_mb: float = 0.0
    memory_limit_mb: float = 0.0
    memory_limit_source: str = ""
    cancelled: bool = False
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class WorkerStartError(RuntimeError):
    """Workers failed to start (import or ``setup()`` error, or no ``ready``
    within ``start_timeout_s``) ``max_start_failures`` times in a row."""


class PoolConfigError(ValueError):
    """A threshold a fresh worker already exceeds (it would recycle or be
    held forever)."""


# --- starting workers from the forkserver without the parent's __main__ ---------


class _LeanPopen(popen_forkserver.Popen):
    """``popen_forkserver.Popen`` minus the parent's ``__main__``.

    multiprocessing re-imports the parent's main module in every child
    started by spawn or forkserver.  Under ``pytest`` that is pytest; under
    a trainer script it is the script and everything it imports (torch...),
    in every worker, on every recycle: exactly the start-up cost and memory
    the forkserver is here to avoid.  The worker's job is named by a
    ``module:callable`` factory, so the main module is never needed.
    (Same body as the stdlib's ``_launch``, CPython 3.11-3.13, with the two
    ``init_main_*`` keys dropped.)
    """

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _WorkerProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _LeanPopen:
        return _LeanPopen(process_obj)


def configure_forkserver(extra: Sequence[str] = ()) -> None:
    """Set the forkserver's preload list to :data:`LEAN_PRELOAD` plus ``extra``.

    The forkserver is one per parent process and reads the list when it
    starts, so the first pool (or other forkserver user) in a process decides
    it; later calls only matter if the server is restarted.
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload([*LEAN_PRELOAD, *extra])


# --- parent-side worker record ------------------------------------------------


@attrs.define(eq=False)
class _Worker:
    wid: int
    max_tasks: int | None
    max_rss: float | None
    state: str = "starting"  # starting -> ready -> retiring -> exiting; any -> dead -> reaped
    process: Any = None
    pid: int | None = None
    stream: FramedStream | None = None
    lifeline: Any = None
    outbox: Any = None
    pending: dict[int, tuple[Any, int]] = attrs.field(factory=dict)
    dispatched: int = 0
    completed: int = 0
    rss: int = 0
    ready_rss: int = 0
    peak_rss: int = 0
    started_at: float = 0.0
    ready_at: float | None = None
    last_seen: float = 0.0
    hb: dict[str, Any] = attrs.field(factory=dict)
    settled: bool = False
    allocator: dict[str, Any] = attrs.field(factory=dict)
    replacement: _Worker | None = None
    retire_reason: str | None = None
    death: str | None = None
    exit_sent: bool = False
    exitcode: int | None = None
    fatal: str | None = None


# --- the pool -----------------------------------------------------------------


class WorkerPool:
    """Run a job's tasks in ``workers`` processes; see the module docstring.

    Args:
        spec: the job, built in each worker.
        workers: worker processes serving at once (>= 1); one more may run
            while a retiring worker hands over.
        concurrency_per_worker: tasks in flight per worker (>= 1).
        max_tasks_per_worker: a worker retires after this many tasks
            (jittered down per worker); ``None``: never by count.
        max_rss_mb: a worker retires when its current RSS (MiB) exceeds this
            (jittered down per worker); ``None``: never by RSS.
        jitter: each worker's thresholds are scaled by a factor drawn
            uniformly from ``[1 - jitter, 1]`` (``0 <= jitter < 1``), so
            workers started together do not retire together.
        high_water_mb, low_water_mb: per-worker admission marks (MiB of
            current RSS); ``None``: no per-worker admission.  ``low_water_mb``
            defaults to 80 % of ``high_water_mb``.
        pool_high_water_fraction, pool_low_water_fraction: the pool's marks,
            as fractions of the memory limit, for the parent's RSS plus every
            worker's.
        memory_limit_mb: the limit the pool's marks refer to; ``None``: the
            cgroup limit or the machine's memory (:func:`memory_limit_bytes`).
        heartbeat_s: cadence of worker heartbeats (seconds).
        heartbeat_timeout_s: a ready worker silent this long is killed and
            replaced (seconds; generous: a blocked loop is a bug, not a blip).
        start_timeout_s: a worker must be ready (job imported and set up)
            within this many seconds of its start.
        max_task_attempts: runs of a task whose worker died, before the pool
            gives up and synthesizes an ``infra`` error row.
        max_start_failures: consecutive worker start failures before
            :class:`WorkerStartError` is raised.
        exit_timeout_s: time a worker told to exit gets for ``teardown()``
            before it is killed; also the worker's own teardown deadline.
        cancel_grace_s: on cancellation, time workers get to answer for
            their cancelled tasks before they are stopped.
        malloc_arena_max, malloc_trim_threshold: allocator settings for
            workers (see :mod:`lowwater.workers.allocator`); ``None``: the
            environment's value, else 2 arenas and 128 KiB; ``"off"``: leave
            that setting to glibc.
        allocator_hygiene: ``False`` leaves the allocator alone.
        trim_at_quiescence: trim the allocator (``malloc_trim``, off the
            loop) whenever a worker's in-flight count drops to zero.
        trim_interval_s: minimum seconds between a worker's ``malloc_trim`` calls.
        gc_at_quiescence: run ``gc.collect()`` when a worker goes idle,
            before trimming (reference cycles hold memory until collected).
        lag_interval_s: period of the worker's loop-lag probe (seconds).
        preload: extra modules for the forkserver to preload (shared by all
            workers: put the job's heavy, fork-safe imports here).
        start_method: ``"forkserver"`` (the default, see the module
            docstring) or ``"spawn"`` (a fresh interpreter per worker that
            also imports the parent's ``__main__``: for comparison only).
        seed: seed of the jitter draws (``None``: random).
        on_event: ``on_event(name, fields)`` for observability and tests;
            called synchronously on the pool's loop; must not block.  Names:
            ``started``, ``ready``, ``dispatch``, ``retiring``, ``exit_sent``,
            ``killed``, ``reaped``, ``worker_held``, ``worker_released``,
            ``pool_held``, ``pool_released``, ``retry``, ``failed``.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(
        self,
        spec: JobSpec,
        *,
        workers: int,
        concurrency_per_worker: int = 8,
        max_tasks_per_worker: int | None = 500,
        max_rss_mb: float | None = None,
        jitter: float = 0.1,
        high_water_mb: float | None = None,
        low_water_mb: float | None = None,
        pool_high_water_fraction: float = 0.85,
        pool_low_water_fraction: float = 0.75,
        memory_limit_mb: float | None = None,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        max_task_attempts: int = 3,
        max_start_failures: int = 3,
        exit_timeout_s: float = 30.0,
        cancel_grace_s: float = 10.0,
        malloc_arena_max: int | str | None = None,
        malloc_trim_threshold: int | str | None = None,
        allocator_hygiene: bool = True,
        trim_at_quiescence: bool = True,
        trim_interval_s: float = 1.0,
        gc_at_quiescence: bool = True,
        lag_interval_s: float = 0.05,
        orphan_grace_s: float = 5.0,
        preload: Sequence[str] = (),
        start_method: str = "forkserver",
        seed: int | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        for name, value in (
            ("workers", workers),
            ("concurrency_per_worker", concurrency_per_worker),
            ("max_task_attempts", max_task_attempts),
            ("max_start_failures", max_start_failures),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, not {value}")
        if max_tasks_per_worker is not None and max_tasks_per_worker < 1:
            raise ValueError(f"max_tasks_per_worker must be >= 1 or None, not {max_tasks_per_worker}")
        if max_rss_mb is not None and max_rss_mb <= 0:
            raise ValueError(f"max_rss_mb must be > 0 or None, not {max_rss_mb}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), not {jitter}")
        for name, value in (
            ("heartbeat_s", heartbeat_s),
            ("heartbeat_timeout_s", heartbeat_timeout_s),
            ("start_timeout_s", start_timeout_s),
            ("exit_timeout_s", exit_timeout_s),
            ("lag_interval_s", lag_interval_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, not {value}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {start_method!r}")
        if heartbeat_timeout_s <= heartbeat_s:
            raise ValueError(f"heartbeat_timeout_s ({heartbeat_timeout_s}) must exceed heartbeat_s ({heartbeat_s})")
        self.spec = spec
        self.workers = workers
        self.concurrency = concurrency_per_worker
        self.max_tasks = max_tasks_per_worker
        self.max_rss_mb = max_rss_mb
        self.jitter = jitter
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_task_attempts = max_task_attempts
        self.max_start_failures = max_start_failures
        self.exit_timeout_s = exit_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.trim_interval_s = trim_interval_s
        self.trim_at_quiescence = trim_at_quiescence
        self.start_method = start_method
        self.gc_at_quiescence = gc_at_quiescence
        self.lag_interval_s = lag_interval_s
        self.orphan_grace_s = orphan_grace_s
        self.preload = tuple(preload)
        self.on_event = on_event
        self.allocator = allocator_mod.resolve(malloc_arena_max, malloc_trim_threshold) if allocator_hygiene else None
        if memory_limit_mb is not None:
            limit, source = int(memory_limit_mb * MIB), "argument"
        else:
            limit, source = memory_limit_bytes()
        self.memory_limit_source = source
        self._admission_args = dict(
            worker_high_bytes=None if high_water_mb is None else high_water_mb * MIB,
            worker_low_bytes=None if low_water_mb is None else low_water_mb * MIB,
            limit_bytes=limit,
            pool_high_fraction=pool_high_water_fraction,
            pool_low_fraction=pool_low_water_fraction,
        )
        self.admission = PoolAdmission(**self._admission_args)  # validates the marks
        self._rng = random.Random(seed)
        self._running = False
        self._workers: list[_Worker] = []
        self._next_wid = 0

    # -- public ---------------------------------------------------------------

    async def run(
        self,
        task_ids: Iterable[Any],
        on_rows: Callable[[list[dict[str, Any]], TaskInfo], Awaitable[None]],
    ) -> PoolReport:
        """Run every task of ``task_ids`` once and hand its rows to ``on_rows``.

        Task ids must be JSON scalars (str or int) or other JSON-able values;
        they are pulled lazily, only when a worker slot is free and admission
        allows.  ``on_rows(rows, info)`` is awaited once per task, one call
        at a time, in completion order; exactly one call per task id
        (re-runs after a worker death are flagged ``info.retried``).
        Workers are started on entry and stopped before return.

        On cancellation, workers are told to cancel their in-flight tasks;
        the rows they send within ``cancel_grace_s`` are still delivered
        (tasks without an answer get no row and can be re-run from their
        ids); then every worker is stopped and reaped, and ``Cancelled``
        propagates.

        Raises:
            RuntimeError: the pool is already running.
            WorkerStartError: workers keep failing to start.
            PoolConfigError: a fresh worker already exceeds ``max_rss_mb``
                or ``high_water_mb``.
            TypeError: a task id is not JSON-serialisable.
            Exception: whatever ``on_rows`` or the iterable raised.
        """
        if self._running:
            raise RuntimeError("this WorkerPool is already running")
        self._running = True
        self._reset()
        self._on_rows = on_rows
        started = time.perf_counter()
        # Peek one id so an empty run (a resumed eval with nothing left)
        # starts no worker; every later id is pulled only when a slot is free.
        it = iter(task_ids)
        try:
            first = next(it)
        except StopIteration:
            self._running = False
            return self._finish_report()
        tasks = itertools.chain([first], it)
        configure_forkserver(self.preload)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._service(self._supervise)
                self._service(self._deliver)
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
        except BaseExceptionGroup as group:
            if group.subgroup(KeyboardInterrupt) is not None:
                raise KeyboardInterrupt from None  # as the CLI expects it, not wrapped
            raise
        finally:
            self._running = False
            self._report.wall_s = round(time.perf_counter() - started, 6)
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
                "state": w.state,
                "rss_mb": round(w.rss / MIB, 2),
                "in_flight": len(w.pending),
                "dispatched": w.dispatched,
                "completed": w.completed,
                "max_tasks": w.max_tasks,
                "max_rss_mb": None if w.max_rss is None else round(w.max_rss / MIB, 2),
                "held": self.admission.worker_held(w.wid),
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

    # -- run state --------------------------------------------------------------

    def _reset(self) -> None:
        self.admission = PoolAdmission(**self._admission_args)
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
        self._failure: BaseException | None = None
        self._service_scopes: set[trio.CancelScope] = set()
        self._main_scope: trio.CancelScope | None = None
        self._wake = trio.Event()
        self._parent_rss = psutil.Process().memory_info().rss
        self._deliver_send, self._deliver_recv = trio.open_memory_channel[tuple[list[dict[str, Any]], TaskInfo]](
            math.inf
        )
        self._start_lock = trio.Lock()

    def _finish_report(self) -> PoolReport:
        r = self._report
        r.admission_holds = self.admission.worker_holds + self.admission.pool.holds
        r.admission_wait_s = round(r.admission_wait_s, 6)
        return r

    def _emit(self, name: str, w: _Worker | None = None, **fields: Any) -> None:
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
        return sum(w.state in ("starting", "ready") for w in self._workers)

    def _need_workers(self) -> bool:
        return not self._exhausted or bool(self._retries)

    # -- dispatch ---------------------------------------------------------------

    def _slots(self, ignore_memory: bool) -> list[_Worker]:
        return [
            w
            for w in self._workers
            if w.state == "ready"
            and len(w.pending) < self.concurrency
            and (ignore_memory or not self.admission.worker_held(w.wid))
        ]

    def _pick(self) -> tuple[_Worker | None, bool, bool]:
        """A worker to run the next task on, whether memory held one back,
        and whether admission is being forced (see :meth:`_may_force`)."""
        if self._backlog >= self.workers * self.concurrency:
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
        if self._in_flight() or any(w.state == "starting" for w in self._workers):
            return False
        return all(w.settled for w in self._workers if w.state == "ready")

    def _next_task(self, it: Iterator[Any]) -> tuple[Any, int] | None:
        if self._retries:
            return self._retries.popleft()
        if self._exhausted:
            return None
        try:
            return next(it), 1
        except StopIteration:
            self._exhausted = True
            self._reconcile()
            return None

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
                await self._changed(timeout=self.heartbeat_s)
                continue
            task = self._next_task(it)
            if task is None:
                await self._changed(timeout=self.heartbeat_s)
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

    # -- the worker set -----------------------------------------------------------

    def _reconcile(self) -> None:
        """Bring the worker set in line with the rules after any change:
        retire workers past their thresholds, start workers up to
        ``workers`` serving (never more than ``workers + 1`` alive), tell
        drained retirees whose replacement is ready to exit."""
        if not self._closing:
            for w in list(self._workers):
                if w.state != "ready":
                    continue
                if w.max_tasks is not None and w.dispatched >= w.max_tasks:
                    self._retire(w, "count")
                elif w.max_rss is not None and w.rss > w.max_rss:
                    self._retire(w, "rss")
                elif (
                    self.admission.worker_held(w.wid)
                    and not w.pending
                    and w.settled
                    and self.admission.worker_low is not None
                    and w.rss > self.admission.worker_low
                ):
                    # Idle, collected and trimmed, still above its low-water
                    # mark: it cannot come back down; recycling is the way.
                    self._retire(w, "rss")
            while self._need_workers() and self._active() < self.workers and self._alive < self.workers + 1:
                self._start_worker()
            for w in list(self._workers):
                if w.state == "retiring" and not w.pending and self._may_exit(w):
                    self._send_exit(w)
        self._notify()

    def _retire(self, w: _Worker, reason: str) -> None:
        w.state = "retiring"
        w.retire_reason = reason
        if reason == "count":
            self._report.recycled_by_count += 1
        else:
            self._report.recycled_by_rss += 1
        self._emit("retiring", w, reason=reason, dispatched=w.dispatched, rss=w.rss)

    def _may_exit(self, w: _Worker) -> bool:
        if w.replacement is not None:
            return w.replacement.ready_at is not None
        return not self._need_workers()

    def _send_exit(self, w: _Worker, why: str = "retired") -> None:
        """Tell ``w`` to exit; ``why`` is ``"retired"`` (drained, replacement
        ready or not needed) or ``"stop"`` (the run is ending)."""
        w.state = "exiting"
        w.exit_sent = True
        if w.outbox is not None:
            w.outbox.send_nowait(encode({"op": "exit"}))
        self._emit("exit_sent", w, why=why, reason=w.retire_reason)

    def _start_worker(self) -> None:
        wid = self._next_wid
        self._next_wid += 1
        f_tasks = self._rng.uniform(1 - self.jitter, 1)
        f_rss = self._rng.uniform(1 - self.jitter, 1)
        w = _Worker(
            wid=wid,
            max_tasks=None if self.max_tasks is None else max(1, round(self.max_tasks * f_tasks)),
            max_rss=None if self.max_rss_mb is None else self.max_rss_mb * MIB * f_rss,
        )
        w.started_at = w.last_seen = time.monotonic()
        replaces = None
        for old in self._workers:
            if old.state == "retiring" and old.replacement is None:
                old.replacement = w
                replaces = old.wid
                break
        self._workers.append(w)
        self._alive += 1
        self._report.workers_started += 1
        self._report.max_workers_alive = max(self._report.max_workers_alive, self._alive)
        self._emit("started", w, alive=self._alive, replaces=replaces, max_tasks=w.max_tasks, max_rss=w.max_rss)
        self._service(self._worker_life, w)

    def _child_config(self, w: _Worker) -> dict[str, Any]:
        return {
            "wid": w.wid,
            "factory": self.spec.factory,
            "kwargs": dict(self.spec.kwargs),
            "heartbeat_s": self.heartbeat_s,
            "lag_interval_s": self.lag_interval_s,
            "trim_interval_s": self.trim_interval_s,
            "trim_at_quiescence": self.trim_at_quiescence,
            "gc_at_quiescence": self.gc_at_quiescence,
            "teardown_timeout_s": self.exit_timeout_s,
            "orphan_grace_s": self.orphan_grace_s,
            "allocator": None if self.allocator is None else attrs.asdict(self.allocator),
        }

    async def _launch(self, w: _Worker) -> None:
        ctx = multiprocessing.get_context(self.start_method)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        life_r, life_w = ctx.Pipe(duplex=False)
        kind = _WorkerProcess if self.start_method == "forkserver" else ctx.Process
        process = kind(
            target=child_mod.main, args=(child_conn, life_r, self._child_config(w)), name=f"lowwater-worker-{w.wid}"
        )

        def start() -> None:
            process.start()
            w.process = process  # set in the thread: a cancelled wait still reaps it

        try:
            async with self._start_lock:
                await trio.to_thread.run_sync(start)
        finally:
            child_conn.close()
            life_r.close()
            if w.process is None:
                parent_conn.close()
                life_w.close()
        w.pid = process.pid
        w.lifeline = life_w
        w.stream = FramedStream.from_fd(child_mod._take_fd(parent_conn))
        w.last_seen = time.monotonic()

    async def _worker_life(self, w: _Worker) -> None:
        try:
            try:
                await self._launch(w)
            except Exception as exc:
                log.error("starting worker %d failed: %r", w.wid, exc)
                w.fatal = f"start failed: {exc!r}"
                return
            send, recv = trio.open_memory_channel[bytes](math.inf)
            w.outbox = send
            if w.exit_sent:  # told to exit while it was being launched
                send.send_nowait(encode({"op": "exit"}))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sender, w, recv)
                await self._reader(w)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._reap(w)

    async def _sender(self, w: _Worker, recv: Any) -> None:
        assert w.stream is not None
        try:
            async for frame in recv:
                await w.stream.send_frame(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the reader sees the end of stream and handles the death

    async def _reader(self, w: _Worker) -> None:
        assert w.stream is not None
        while True:
            try:
                message = await w.stream.receive()
            except ProtocolError as exc:
                log.error("worker %d (pid %s) sent a bad frame: %s", w.wid, w.pid, exc)
                message = None
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                message = None  # a killed worker resets the connection: handled as its end
            if message is None:
                break
            w.last_seen = time.monotonic()
            self._handle(w, message)
        if w.death is None and not w.exit_sent:
            w.death = "crash"
        if w.state != "dead":
            w.state = "dead"
            self._reconcile()

    def _handle(self, w: _Worker, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "result":
            item = w.pending.pop(int(message["seq"]), None)
            self._update_rss(w, int(message["rss"]))
            w.settled = False
            if item is not None:
                task_id, attempt = item
                w.completed += 1
                info = TaskInfo(task_id, attempt, attempt > 1, w.pid, w.wid, str(message["status"]))
                self._push(message["rows"], info)
            self._reconcile()
        elif op == "hb":
            w.hb = message
            w.settled = bool(message.get("settled")) and not w.pending
            self._update_rss(w, int(message["rss"]))
            self._reconcile()
        elif op == "ready":
            self._on_ready(w, message)
        elif op == "fatal":
            w.fatal = str(message.get("error"))
            self._last_fatal = w.fatal
            log.error("worker %d (pid %s): %s", w.wid, w.pid, w.fatal)
        else:
            log.warning("worker %d sent unknown message %r", w.wid, op)

    def _on_ready(self, w: _Worker, message: dict[str, Any]) -> None:
        if w.state != "starting":
            return
        rss = int(message["rss"])
        w.allocator = message.get("allocator") or {}
        w.ready_at = time.monotonic()
        w.ready_rss = rss
        self._consecutive_start_failures = 0
        if w.max_rss is not None and rss >= w.max_rss:
            self._fail(
                PoolConfigError(
                    f"a fresh worker's RSS is {rss / MIB:.1f} MiB after setup, above its max_rss_mb of "
                    f"{w.max_rss / MIB:.1f} (jittered); it would recycle forever"
                )
            )
        elif self.admission.worker_high is not None and rss >= self.admission.worker_high:
            self._fail(
                PoolConfigError(
                    f"a fresh worker's RSS is {rss / MIB:.1f} MiB after setup, above high_water_mb "
                    f"({self.admission.worker_high / MIB:.1f}); it would never be admitted"
                )
            )
        w.state = "ready"
        self._update_rss(w, rss)
        self._emit(
            "ready",
            w,
            rss=rss,
            import_s=message.get("import_s"),
            setup_s=message.get("setup_s"),
            start_s=round(w.ready_at - w.started_at, 6),
            allocator=w.allocator,
        )
        self._reconcile()

    def _update_rss(self, w: _Worker, rss: int) -> None:
        w.rss = rss
        w.peak_rss = max(w.peak_rss, rss)
        self._report.worker_rss_peak_mb = max(self._report.worker_rss_peak_mb, round(rss / MIB, 2))
        held, changed = self.admission.worker(w.wid, rss)
        if changed:
            self._emit("worker_held" if held else "worker_released", w, rss=rss)
        self._update_pool()

    def _update_pool(self) -> None:
        total = self._parent_rss + sum(w.rss for w in self._workers if w.state not in ("dead", "reaped"))
        self._report.pool_rss_peak_mb = max(self._report.pool_rss_peak_mb, round(total / MIB, 2))
        held, changed = self.admission.update_pool(total)
        if changed:
            self._emit("pool_held" if held else "pool_released", rss=total)

    # -- supervision --------------------------------------------------------------

    async def _supervise(self) -> None:
        """Watchdog and sampler: parent RSS, pool admission, missed heartbeats."""
        me = psutil.Process()
        period = min(self.heartbeat_s, 1.0)
        previous = time.monotonic()
        while True:
            self._parent_rss = me.memory_info().rss
            self._update_pool()
            now = time.monotonic()
            stalled = now - previous - period
            previous = now
            if stalled > period:
                # This loop (the parent's) was blocked: the workers' messages
                # are waiting unread, so that time is not their silence.
                for w in self._workers:
                    w.last_seen += stalled
            for w in list(self._workers):
                if w.state in ("dead", "reaped") or w.process is None:
                    continue
                limit = self.start_timeout_s if w.ready_at is None else self.heartbeat_timeout_s
                if now - w.last_seen > limit:
                    self._kill(
                        w, "heartbeat" if w.ready_at is not None else "start-timeout", silent_s=now - w.last_seen
                    )
            self._reconcile()
            await trio.sleep(period)

    def _kill(self, w: _Worker, reason: str, **fields: Any) -> None:
        if w.death is None:
            w.death = reason
        if reason == "heartbeat" and not self._closing and w.state in ("ready", "retiring"):
            self._report.replaced_after_heartbeat_timeout += 1
        self._emit("killed", w, reason=reason, **fields)
        try:
            w.process.kill()
        except (OSError, ValueError, AttributeError):
            pass

    async def _reap(self, w: _Worker) -> None:
        """Wait for the process to end (killing it if it lingers), then
        account for it: re-run or fail its in-flight tasks, free its slot."""
        process = w.process
        if process is not None:
            grace = self.exit_timeout_s if (w.exit_sent and w.death is None) else 5.0
            if not await self._wait_exit(process, grace):
                self._kill(w, w.death or "exit-timeout")
                await self._wait_exit(process, 30.0)
            w.exitcode = process.exitcode
            try:
                process.close()
            except ValueError:
                pass
        for resource in (w.stream, w.lifeline):
            if resource is not None:
                try:
                    await resource.aclose() if isinstance(resource, FramedStream) else resource.close()
                except (OSError, trio.ClosedResourceError):
                    pass
        if w.outbox is not None:
            w.outbox.close()
            w.outbox = None
        w.state = "reaped"
        self._alive -= 1
        self._workers.remove(w)
        self.admission.retire(w.wid)
        self._emit("reaped", w, exitcode=w.exitcode, death=w.death, alive=self._alive)
        self._after_reap(w)

    @staticmethod
    async def _wait_exit(process: Any, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            while process.exitcode is None:
                await trio.lowlevel.wait_readable(process.sentinel)
            return True
        return process.exitcode is not None

    def _after_reap(self, w: _Worker) -> None:
        if w.ready_at is None and not self._closing:
            self._report.start_failures += 1
            self._consecutive_start_failures += 1
            self._last_fatal = w.fatal or self._last_fatal
            if self._consecutive_start_failures >= self.max_start_failures:
                self._fail(
                    WorkerStartError(
                        f"{self._consecutive_start_failures} worker starts failed in a row; last: "
                        f"{self._last_fatal or f'exit code {w.exitcode}'}"
                    )
                )
        elif w.death == "crash" and not self._closing:
            self._report.replaced_after_crash += 1
        if w.pending:
            if w.death == "heartbeat":
                why = f"killed after no heartbeat for over {self.heartbeat_timeout_s:g} s"
            else:
                why = f"exit code {w.exitcode}"
            for task_id, attempt in w.pending.values():
                self._task_lost(task_id, attempt, w, why)
            w.pending.clear()
        for other in self._workers:
            if other.replacement is w:
                other.replacement = None
        self._reconcile()

    def _task_lost(self, task_id: Any, attempt: int, w: _Worker, why: str) -> None:
        if self._closing:
            return  # shutting down: no row; the id can be re-run (eval --resume)
        if attempt < self.max_task_attempts:
            self._retries.append((task_id, attempt + 1))
            self._report.retried_tasks += 1
            self._emit("retry", w, task_id=task_id, attempt=attempt + 1, why=why)
            return
        self._report.failed_tasks += 1
        self._emit("failed", w, task_id=task_id, attempt=attempt, why=why)
        row = {
            "task_id": task_id,
            "attempt": attempt,
            "error": {
                "class": "infra",
                "message": f"worker died while running this task ({why}; pid {w.pid}); "
                f"gave up after {attempt} attempt{'s' if attempt > 1 else ''}",
            },
            "worker_pid": w.pid,
        }
        self._push([row], TaskInfo(task_id, attempt, attempt > 1, w.pid, w.wid, "failed"))

    # -- stopping -----------------------------------------------------------------

    async def _stop_gracefully(self) -> None:
        """Every task has its rows: tell every worker to exit and reap them."""
        self._closing = True
        for w in list(self._workers):
            if w.state in ("starting", "ready", "retiring"):
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
        with trio.move_on_after(self.cancel_grace_s):
            while self._in_flight() or (self._backlog and self._failure is None):
                await self._changed(timeout=0.5)
        for w in list(self._workers):
            if w.state in ("starting", "ready", "retiring"):
                self._send_exit(w, "stop")
        with trio.move_on_after(min(self.exit_timeout_s, self.cancel_grace_s)):
            while self._alive:
                await self._changed(timeout=0.5)

    @trio.lowlevel.enable_ki_protection
    async def _kill_all(self) -> None:
        """Leave no process behind: SIGKILL whatever is alive and wait for reaping."""
        self._closing = True
        for w in list(self._workers):
            if w.process is not None and w.state != "reaped":
                self._kill(w, w.death or "shutdown")
        with trio.move_on_after(30.0):
            while self._alive:
                await self._changed(timeout=0.5)
        if self._alive:
            log.error("%d worker processes could not be reaped", self._alive)
