"""The worker half of :class:`~lowwater.workers.WorkerPool`: start, read,
watch, retire, kill and reap worker processes, and account for the tasks of
those that die.

Kept apart from the pool's dispatch and delivery (``pool.py``) so each half
reads on its own; it is a mixin, not a separate object, because both halves
act on one run's state and each change ends in the same ``_reconcile``.

Shared run state (created by ``WorkerPool._reset`` for each ``run``):
``config``, ``spec``, ``admission``, ``allocator``, ``_workers`` (records,
including retirees), ``_alive`` (processes not yet reaped), ``_report``,
``_retries`` (task ids to re-run first), ``_closing`` (start and re-run
nothing), ``_start_lock``, ``_parent_rss``, ``_rng`` (jitter draws), ``_next_wid``,
``_consecutive_start_failures``, ``_last_fatal``; and the pool's hooks
``_emit``, ``_notify``, ``_service``, ``_fail``, ``_push``,
``_need_workers`` and ``_active``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import random
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import attrs
import psutil
import trio

from lowwater.workers import child as child_mod
from lowwater.workers.admission import MIB, PoolAdmission
from lowwater.workers.allocator import AllocatorSettings
from lowwater.workers.config import PoolConfig
from lowwater.workers.contract import JobSpec, PoolConfigError, PoolReport, TaskInfo, WorkerStartError
from lowwater.workers.launcher import LeanProcess
from lowwater.workers.protocol import FramedStream, ProtocolError, encode
from lowwater.workers.record import WorkerRecord, WorkerState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

log = logging.getLogger("lowwater.workers")


class WorkerSupervision:
    """Mixin of :class:`~lowwater.workers.WorkerPool`; see the module docstring."""

    config: PoolConfig
    spec: JobSpec
    admission: PoolAdmission
    allocator: AllocatorSettings | None
    _workers: list[WorkerRecord]
    _alive: int
    _report: PoolReport
    _retries: deque[tuple[Any, int]]
    _closing: bool
    _start_lock: trio.Lock
    _parent_rss: int
    _next_wid: int
    _rng: random.Random
    _consecutive_start_failures: int
    _last_fatal: str | None

    if TYPE_CHECKING:  # provided by WorkerPool

        def _emit(self, name: str, w: WorkerRecord | None = None, **fields: Any) -> None: ...
        def _notify(self) -> None: ...
        def _service(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None: ...
        def _fail(self, exc: BaseException) -> None: ...
        def _push(self, rows: list[dict[str, Any]], info: TaskInfo) -> None: ...
        def _need_workers(self) -> bool: ...
        def _active(self) -> int: ...
        def _pin(self, w: WorkerRecord, task_id: Any) -> None: ...
        def _pinned(self, w: WorkerRecord) -> bool: ...

    # -- the worker set ---------------------------------------------------------

    def _reconcile(self) -> None:
        """Bring the worker set in line with the rules after any change:
        retire workers past their thresholds, start workers up to
        ``workers`` serving (never more than ``workers + 1`` alive), tell
        drained retirees whose replacement is ready to exit."""
        if not self._closing:
            for w in list(self._workers):
                if w.state is not WorkerState.READY:
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
            while (
                self._need_workers() and self._active() < self.config.workers and self._alive < self.config.workers + 1
            ):
                self._start_worker()
            for w in list(self._workers):
                if w.state is WorkerState.RETIRING and not w.pending and self._may_exit(w):
                    self._send_exit(w)
        self._notify()

    def _retire(self, w: WorkerRecord, reason: str) -> None:
        w.state = WorkerState.RETIRING
        w.retire_reason = reason
        if reason == "count":
            self._report.recycled_by_count += 1
        else:
            self._report.recycled_by_rss += 1
        self._emit("retiring", w, reason=reason, dispatched=w.dispatched, rss=w.rss)

    def _may_exit(self, w: WorkerRecord) -> bool:
        if self._pinned(w):
            return False  # it produced data of a step not yet cleared (WorkerPool pin_by)
        if w.replacement is not None:
            return w.replacement.ready_at is not None
        return not self._need_workers()

    def _send_exit(self, w: WorkerRecord, why: str = "retired") -> None:
        """Tell ``w`` to exit; ``why`` is ``"retired"`` (drained, replacement
        ready or not needed) or ``"stop"`` (the run is ending)."""
        w.state = WorkerState.EXITING
        w.exit_sent = True
        if w.outbox is not None:
            w.outbox.send_nowait(encode({"op": "exit"}))
        self._emit("exit_sent", w, why=why, reason=w.retire_reason)

    def _start_worker(self) -> None:
        wid = self._next_wid
        self._next_wid += 1
        c = self.config
        f_tasks = self._rng.uniform(1 - c.jitter, 1)
        f_rss = self._rng.uniform(1 - c.jitter, 1)
        w = WorkerRecord(
            wid=wid,
            max_tasks=None if c.max_tasks_per_worker is None else max(1, round(c.max_tasks_per_worker * f_tasks)),
            max_rss=None if c.max_rss_mb is None else c.max_rss_mb * MIB * f_rss,
        )
        w.started_at = w.last_seen = time.monotonic()
        replaces = None
        for old in self._workers:
            if old.state is WorkerState.RETIRING and old.replacement is None:
                old.replacement = w
                replaces = old.wid
                break
        self._workers.append(w)
        self._alive += 1
        self._report.workers_started += 1
        self._report.max_workers_alive = max(self._report.max_workers_alive, self._alive)
        self._emit("started", w, alive=self._alive, replaces=replaces, max_tasks=w.max_tasks, max_rss=w.max_rss)
        self._service(self._worker_life, w)

    def _child_config(self, w: WorkerRecord) -> dict[str, Any]:
        c = self.config
        return {
            "wid": w.wid,
            "factory": self.spec.factory,
            "kwargs": dict(self.spec.kwargs),
            "heartbeat_s": c.heartbeat_s,
            "lag_interval_s": c.lag_interval_s,
            "trim_interval_s": c.trim_interval_s,
            "trim_at_quiescence": c.trim_at_quiescence,
            "gc_at_quiescence": c.gc_at_quiescence,
            "teardown_timeout_s": c.exit_timeout_s,
            "orphan_grace_s": c.orphan_grace_s,
            "allocator": None if self.allocator is None else attrs.asdict(self.allocator),
        }

    async def _launch(self, w: WorkerRecord) -> None:
        ctx = multiprocessing.get_context(self.config.start_method)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        life_r, life_w = ctx.Pipe(duplex=False)
        # typeshed's BaseContext (what get_context returns) lacks .Process; every concrete context has it.
        kind: Any = LeanProcess if self.config.start_method == "forkserver" else ctx.Process  # type: ignore[attr-defined]
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

    async def _worker_life(self, w: WorkerRecord) -> None:
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

    async def _sender(self, w: WorkerRecord, recv: Any) -> None:
        assert w.stream is not None
        try:
            async for frame in recv:
                await w.stream.send_frame(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the reader sees the end of stream and handles the death

    async def _reader(self, w: WorkerRecord) -> None:
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
        if w.state is not WorkerState.DEAD:
            w.state = WorkerState.DEAD
            self._reconcile()

    def _handle(self, w: WorkerRecord, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "result":
            item = w.pending.pop(int(message["seq"]), None)
            self._update_rss(w, int(message["rss"]))
            w.settled = False
            if item is not None:
                task_id, attempt = item
                w.completed += 1
                info = TaskInfo(task_id, attempt, attempt > 1, w.pid, w.wid, str(message["status"]))
                self._pin(w, task_id)
                self._push(message["rows"], info)
            self._reconcile()
        elif op == "hb":
            w.hb = message
            w.settled = bool(message.get("settled")) and not w.pending
            self._update_rss(w, int(message["rss"]))
            self._reconcile()
        elif op == "ready":
            self._on_ready(w, message)
        elif op == "leftovers":
            left = {str(k): int(v) for k, v in dict(message.get("leftovers") or {}).items()}
            log.warning("worker %d (pid %s) ended with per-task state left: %s", w.wid, w.pid, left)
            for key, count in left.items():
                self._report.leftovers[key] = self._report.leftovers.get(key, 0) + count
        elif op == "fatal":
            w.fatal = str(message.get("error"))
            self._last_fatal = w.fatal
            log.error("worker %d (pid %s): %s", w.wid, w.pid, w.fatal)
        else:
            log.warning("worker %d sent unknown message %r", w.wid, op)

    def _on_ready(self, w: WorkerRecord, message: dict[str, Any]) -> None:
        if w.state is not WorkerState.STARTING:
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
        w.state = WorkerState.READY
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

    def _update_rss(self, w: WorkerRecord, rss: int) -> None:
        w.rss = rss
        w.peak_rss = max(w.peak_rss, rss)
        self._report.worker_rss_peak_mb = max(self._report.worker_rss_peak_mb, round(rss / MIB, 2))
        held, changed = self.admission.worker(w.wid, rss)
        if changed:
            self._emit("worker_held" if held else "worker_released", w, rss=rss)
        self._update_pool()

    def _update_pool(self) -> None:
        total = self._parent_rss + sum(w.rss for w in self._workers if not w.state.gone)
        self._report.pool_rss_peak_mb = max(self._report.pool_rss_peak_mb, round(total / MIB, 2))
        held, changed = self.admission.update_pool(total)
        if changed:
            self._emit("pool_held" if held else "pool_released", rss=total)

    # -- supervision --------------------------------------------------------------

    async def _supervise(self) -> None:
        """Watchdog and sampler: parent RSS, pool admission, missed heartbeats."""
        me = psutil.Process()
        period = min(self.config.heartbeat_s, 1.0)
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
                if w.state.gone or w.process is None:
                    continue
                limit = self.config.start_timeout_s if w.ready_at is None else self.config.heartbeat_timeout_s
                if now - w.last_seen > limit:
                    self._kill(
                        w, "heartbeat" if w.ready_at is not None else "start-timeout", silent_s=now - w.last_seen
                    )
            self._reconcile()
            await trio.sleep(period)

    def _kill(self, w: WorkerRecord, reason: str, **fields: Any) -> None:
        if w.death is None:
            w.death = reason
        if reason == "heartbeat" and not self._closing and w.state in (WorkerState.READY, WorkerState.RETIRING):
            self._report.replaced_after_heartbeat_timeout += 1
        self._emit("killed", w, reason=reason, **fields)
        try:
            w.process.kill()
        except (OSError, ValueError, AttributeError):
            pass

    async def _reap(self, w: WorkerRecord) -> None:
        """Wait for the process to end (killing it if it lingers), then
        account for it: re-run or fail its in-flight tasks, free its slot."""
        process = w.process
        if process is not None:
            grace = self.config.exit_timeout_s if (w.exit_sent and w.death is None) else 5.0
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
        w.state = WorkerState.REAPED
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

    def _after_reap(self, w: WorkerRecord) -> None:
        if w.ready_at is None and not self._closing:
            self._report.start_failures += 1
            self._consecutive_start_failures += 1
            self._last_fatal = w.fatal or self._last_fatal
            if self._consecutive_start_failures >= self.config.max_start_failures:
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
                why = f"killed after no heartbeat for over {self.config.heartbeat_timeout_s:g} s"
            else:
                why = f"exit code {w.exitcode}"
            for task_id, attempt in w.pending.values():
                self._task_lost(task_id, attempt, w, why)
            w.pending.clear()
        for other in self._workers:
            if other.replacement is w:
                other.replacement = None
        self._reconcile()

    def _task_lost(self, task_id: Any, attempt: int, w: WorkerRecord, why: str) -> None:
        if self._closing:
            return  # shutting down: no row; the id can be re-run (eval --resume)
        if attempt < self.config.max_task_attempts:
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
