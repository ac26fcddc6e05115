"""The worker process: one Trio loop serving many tasks of one job.

Started by :class:`lowwater.workers.WorkerPool` from the forkserver, so this
module and what it imports at module level (trio, orjson, psutil, attrs)
are preloaded once and shared copy-on-write by every worker; the job's own
imports happen in :func:`load_factory`, in the worker, after the fork.

Life of a worker (messages in ``docs/workers.md``):

1. :func:`main` ignores SIGINT (the parent orchestrates Ctrl-C so cancelled
   tasks still get their rows), asks the kernel to SIGKILL it if its parent
   (the forkserver) dies, applies the allocator settings, and starts a
   lifeline thread that notices the pool's owner dying even while the loop
   is blocked;
2. the job is built from its spec and ``setup()`` runs; ``ready`` is sent;
3. ``run`` messages start tasks; each task's rows go back in a ``result``;
   when the last in-flight task ends the worker trims the allocator off the
   loop (a quiescent point) and reports its RSS;
4. a heartbeat (RSS, in-flight, loop lag p50/p99, job stats) is queued on a
   fixed cadence; a single writer task sends queued frames, and a newer
   heartbeat replaces an unsent one, so a slow parent never blocks the loop
   and never builds a backlog;
5. ``cancel`` cancels in-flight tasks (their rows are still sent);
   ``exit``, end of stream or SIGTERM end the loop: in-flight tasks are
   cancelled, ``teardown()`` runs under a deadline, the process exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import trio

from lowwater.memory import Trimmer, malloc_trim_available, rss_bytes
from lowwater.workers import allocator
from lowwater.workers.protocol import FramedStream, encode

PR_SET_PDEATHSIG = 1

#: Exit code of a worker whose job could not be loaded or set up.
EXIT_SETUP_FAILED = 3


def load_factory(spec: str) -> Any:
    """Import ``"package.module:callable"`` (dots allowed after the colon).

    Raises:
        ValueError: ``spec`` is not of that form.
        ImportError, AttributeError: the module or attribute does not exist.
    """
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"job factory must be 'module:callable', not {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``: the kernel sends ``sig`` when this
    process's parent (the forkserver) exits.  Linux only; False elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill_descendants() -> None:
    """Best effort: SIGKILL this process's descendants (runtimes the job started)."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:
        pass


def _watch_lifeline(fd: int, grace_s: float, owner: _Child) -> None:
    """Thread: end the worker when the pool's owner dies.

    The owner holds the write end of the lifeline pipe and never writes, so
    end of file means it is gone (the kernel closes its descriptors even on
    SIGKILL).  A change of ``getppid()`` means the forkserver died.  Either
    way the loop is asked to stop; if it has not exited ``grace_s`` later
    (a job blocking the loop), descendants are killed and then the worker.
    This runs in a thread so that a blocked loop cannot delay it.
    """
    ppid = os.getppid()
    while True:
        try:
            readable, _, _ = select.select([fd], [], [], 1.0)
        except (OSError, ValueError):
            break
        if readable:
            try:
                if os.read(fd, 1):
                    continue
            except OSError:
                pass
            break
        if os.getppid() != ppid:
            break
    token = owner.trio_token
    if token is not None:
        try:
            # Not trio.from_thread.run_sync: that waits for the loop, which
            # may be the very thing that is blocked.
            token.run_sync_soon(owner.owner_gone)
        except trio.RunFinishedError:
            pass
    time.sleep(grace_s)
    _kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)


def _take_fd(conn: Any) -> int:
    """The descriptor behind a ``multiprocessing`` Connection, now owned by the caller."""
    fd = os.dup(conn.fileno())
    conn.close()
    return fd


def main(conn: Any, lifeline: Any, config: dict[str, Any]) -> None:
    """Process entry point (the ``multiprocessing.Process`` target).

    Args:
        conn: this end of the message socket (a ``multiprocessing`` Connection,
            detached into a :class:`FramedStream`).
        lifeline: read end of the lifeline pipe (a Connection).
        config: plain dict built by the pool (see ``WorkerPool._child_config``).

    Exits with 0 after an orderly stop, :data:`EXIT_SETUP_FAILED` when the job
    could not be built or set up.
    """
    # Ctrl-C reaches the whole foreground process group; the parent turns it
    # into a "cancel" so cancelled tasks still deliver their rows.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    report: dict[str, Any] = {}
    if config.get("allocator") is not None:
        report = allocator.apply(allocator.AllocatorSettings(**config["allocator"]))
    child = _Child(config, report)
    life_fd = _take_fd(lifeline)
    threading.Thread(
        target=_watch_lifeline, args=(life_fd, config["orphan_grace_s"], child), name="lowwater-lifeline", daemon=True
    ).start()
    code = trio.run(child.main, _take_fd(conn))
    if code:
        raise SystemExit(code)


class _Outbox:
    """Frames waiting for the single writer task; heartbeats coalesce."""

    def __init__(self) -> None:
        self._frames: deque[bytes] = deque()
        self._heartbeat: Any = None
        self._wake = trio.Event()
        self._drained = trio.Event()
        self._drained.set()
        self.broken = False

    def put(self, frame: bytes) -> None:
        if self.broken:
            return
        self._frames.append(frame)
        self._kick()

    def heartbeat(self, build: Any) -> None:
        """Queue a heartbeat; ``build()`` makes its message when it is sent,
        so a queued heartbeat is never stale and never queued twice."""
        if self.broken:
            return
        self._heartbeat = build
        self._kick()

    def _kick(self) -> None:
        self._drained = trio.Event() if self._drained.is_set() else self._drained
        self._wake.set()

    async def flush(self) -> None:
        await self._drained.wait()

    async def run(self, stream: FramedStream) -> None:
        try:
            while True:
                if not self._frames and self._heartbeat is None:
                    self._drained.set()
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                if self._frames:
                    frame = self._frames.popleft()
                else:
                    build, self._heartbeat = self._heartbeat, None
                    frame = build()
                await stream.send_frame(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The parent is gone: nothing will read these.
            self.broken = True
            self._frames.clear()
            self._heartbeat = None
            self._drained.set()


class _Child:
    def __init__(self, config: dict[str, Any], allocator_report: dict[str, Any]) -> None:
        self.config = config
        self.allocator_report = allocator_report
        self.wid = config["wid"]
        self.pid = os.getpid()
        self.outbox = _Outbox()
        self.job: Any = None
        self.in_flight: dict[int, trio.CancelScope] = {}
        self.done = 0
        self.lags: deque[float] = deque(maxlen=int(config.get("lag_window", 200)))
        self.settled = False
        self.trimmer = Trimmer(config["trim_interval_s"])
        self._quiescing = False
        self._ticking = False
        self.trio_token: Any = None
        # Created up front so stop() during setup cancels the loop before it starts.
        self.read_scope = trio.CancelScope()
        self.stop_reason = ""
        self._nursery_for_quiesce: trio.Nursery | None = None

    # -- entry --------------------------------------------------------------

    async def main(self, fd: int) -> int:
        self.trio_token = trio.lowlevel.current_trio_token()
        stream = FramedStream.from_fd(fd)
        code = 0
        try:
            async with trio.open_nursery() as infra:
                infra.start_soon(self.outbox.run, stream)
                infra.start_soon(self._heartbeats)
                infra.start_soon(self._lag_probe)
                infra.start_soon(self._sigterm)
                code = await self._serve(stream)
                with trio.move_on_after(self.config["teardown_timeout_s"]):
                    await self.outbox.flush()
                infra.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
        return code

    def owner_gone(self) -> None:
        """Called from the lifeline thread (via the Trio token)."""
        self.stop("owner gone")

    def stop(self, reason: str) -> None:
        """End the read loop; in-flight tasks are cancelled."""
        if not self.stop_reason:
            self.stop_reason = reason
        self.cancel_all()
        self.read_scope.cancel()

    def cancel_all(self) -> None:
        for scope in self.in_flight.values():
            scope.cancel()

    # -- serving ------------------------------------------------------------

    async def _serve(self, stream: FramedStream) -> int:
        started = time.perf_counter()
        try:
            factory = load_factory(self.config["factory"])
            self.job = factory(**self.config["kwargs"])
        except Exception:
            self._fatal("building the job")
            return EXIT_SETUP_FAILED
        import_s = time.perf_counter() - started
        async with trio.open_nursery() as services:
            # setup() and teardown() run in this task, strictly nested around
            # the serving loop: setup may enter async context managers (an
            # AsyncExitStack) that teardown exits; self.nursery hosts services.
            try:
                self.job.nursery = services
            except AttributeError:
                pass
            try:
                await self.job.setup()
            except Exception:
                self._fatal("job setup")
                services.cancel_scope.cancel()
                return EXIT_SETUP_FAILED
            self.outbox.put(
                encode(
                    {
                        "op": "ready",
                        "pid": self.pid,
                        "rss": rss_bytes(),
                        "import_s": round(import_s, 6),
                        "setup_s": round(time.perf_counter() - started - import_s, 6),
                        "allocator": self.allocator_report,
                        "malloc_trim": malloc_trim_available(),
                    }
                )
            )
            try:
                async with trio.open_nursery() as tasks:
                    with self.read_scope:
                        await self._read_loop(stream, tasks)
                    self.cancel_all()
            finally:
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + self.config["teardown_timeout_s"]
                    try:
                        await self.job.teardown()
                    except Exception:
                        traceback.print_exc()
                    try:
                        leftovers = self.job.leftovers()
                    except Exception:
                        traceback.print_exc()
                        leftovers = {"leftovers_check_failed": 1}
                    if leftovers:
                        self.outbox.put(encode({"op": "leftovers", "pid": self.pid, "leftovers": leftovers}))
                services.cancel_scope.cancel()
        return 0

    def _fatal(self, what: str) -> None:
        text = traceback.format_exc()
        sys.stderr.write(f"lowwater worker {self.wid}: {what} failed\n{text}")
        self.outbox.put(encode({"op": "fatal", "pid": self.pid, "error": f"{what} failed: {text[-4000:]}"}))

    async def _read_loop(self, stream: FramedStream, tasks: trio.Nursery) -> None:
        while True:
            try:
                message = await stream.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                message = None
            if message is None:
                self.stop_reason = self.stop_reason or "end of stream"
                return
            op = message.get("op")
            if op == "run":
                seq = int(message["seq"])
                scope = trio.CancelScope()
                self.in_flight[seq] = scope
                self.settled = False
                tasks.start_soon(self._run_task, seq, message["task_id"], int(message["attempt"]), scope)
            elif op == "cancel":
                self.cancel_all()
            elif op == "exit":
                self.stop_reason = "exit"
                return
            else:
                sys.stderr.write(f"lowwater worker {self.wid}: unknown message {op!r}\n")

    async def _run_task(self, seq: int, task_id: Any, attempt: int, scope: trio.CancelScope) -> None:
        status = "ok"
        rows: Any = None
        try:
            with scope:
                try:
                    rows = await self.job.run(task_id, attempt)
                except Exception as exc:  # a job bug: one error row, the worker lives on
                    status = "error"
                    rows = [self._error_row(task_id, attempt, "infra", f"job raised {type(exc).__name__}: {exc}")]
                    traceback.print_exc()
            if scope.cancelled_caught:
                status, rows = "cancelled", [self._error_row(task_id, attempt, "cancelled", "cancelled at shutdown")]
            elif scope.cancel_called and status == "ok":
                status = "cancelled"  # the job caught the cancellation and returned its own rows
            if status == "ok" and not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
                status = "error"
                rows = [
                    self._error_row(
                        task_id, attempt, "infra", f"job returned {type(rows).__name__}, not a list of dicts"
                    )
                ]
        finally:
            del self.in_flight[seq]
            self.done += 1
        message = {"op": "result", "seq": seq, "status": status, "rows": rows, "rss": rss_bytes()}
        try:
            frame = encode(message)
        except Exception as exc:  # rows not JSON-serialisable, or too large
            message["status"] = "error"
            message["rows"] = [self._error_row(task_id, attempt, "infra", f"rows could not be sent: {exc}")]
            frame = encode(message)
        del rows, message
        self.outbox.put(frame)
        if not self.in_flight:
            self._spawn_quiesce()

    def _error_row(self, task_id: Any, attempt: int, cls: str, message: str) -> dict[str, Any]:
        return {
            "task_id": task_id,
            "attempt": attempt,
            "error": {"class": cls, "message": message},
            "worker_pid": self.pid,
        }

    # -- quiescent points ---------------------------------------------------

    def _spawn_quiesce(self) -> None:
        if not self._quiescing and self._nursery_for_quiesce is not None:
            self._quiescing = True
            self._nursery_for_quiesce.start_soon(self._quiesce)

    async def _quiesce(self) -> None:
        """Nothing in flight: collect cycles, trim the allocator off the loop,
        report the settled RSS.  Retries a rate-limited trim while still idle."""
        try:
            while not self.in_flight:
                if self.config["gc_at_quiescence"]:
                    gc.collect()
                if not self.config["trim_at_quiescence"] or not malloc_trim_available():
                    self.settled = True
                    break
                ran = await trio.to_thread.run_sync(self.trimmer)
                if self.in_flight:
                    break
                if ran:
                    self.settled = True
                    break
                await trio.sleep(self.trimmer.min_interval_s)
            if self.settled:
                self.outbox.heartbeat(self._heartbeat_frame)
        finally:
            self._quiescing = False

    # -- heartbeats and loop lag -------------------------------------------

    def _heartbeat_message(self) -> dict[str, Any]:
        lags = sorted(self.lags)
        stats: Any = {}
        if self.job is not None:
            try:
                stats = self.job.stats()
            except Exception as exc:
                stats = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "op": "hb",
            "rss": rss_bytes(),
            "in_flight": len(self.in_flight),
            "done": self.done,
            "idle": not self.in_flight,
            "settled": self.settled and not self.in_flight,
            "lag_p50_ms": round(1000 * _quantile(lags, 0.5), 3),
            "lag_p99_ms": round(1000 * _quantile(lags, 0.99), 3),
            "trims": self.trimmer.calls,
            "job": stats,
        }

    def _heartbeat_frame(self) -> bytes:
        message = self._heartbeat_message()
        try:
            return encode(message)
        except Exception as exc:  # job stats not serialisable
            message["job"] = {"error": f"stats could not be sent: {exc}"}
            return encode(message)

    async def _heartbeats(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery_for_quiesce = nursery
            interval = self.config["heartbeat_s"]
            while True:
                self.outbox.heartbeat(self._heartbeat_frame)
                if self.job is not None and not self._ticking and hasattr(self.job, "tick"):
                    self._ticking = True
                    nursery.start_soon(self._tick)
                await trio.sleep(interval)

    async def _tick(self) -> None:
        """The job's periodic hook (the eval job fires ``worker_tick`` here);
        a separate task, so a slow tick never delays a heartbeat."""
        try:
            await self.job.tick({"rss_bytes": rss_bytes(), "in_flight": len(self.in_flight), "finished": self.done})
        except Exception:
            traceback.print_exc()
        finally:
            self._ticking = False

    async def _lag_probe(self) -> None:
        """Event-loop lag: how much later than asked a sleeping task wakes (s)."""
        interval = self.config["lag_interval_s"]
        while True:
            t0 = trio.current_time()
            await trio.sleep(interval)
            self.lags.append(max(0.0, trio.current_time() - t0 - interval))

    async def _sigterm(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                self.stop("SIGTERM")


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
