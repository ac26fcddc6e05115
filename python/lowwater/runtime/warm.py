"""Warm workers, client side: one long-lived process per script.

docs/design.md#incidents: scoring paid a 0.2 s import per rollout in a fresh
interpreter.  A warm worker (:mod:`lowwater.runtime._warm_worker`) imports a
script once and answers many calls to its ``main(argv) -> str`` over
JSON payloads in :mod:`lowwater.framing` frames on its stdin/stdout.

Decisions:

* **One worker per script** (per runtime), not one per runtime: scripts do
  not share module state or ``sys.modules``, and a crash takes down one
  script's worker only.  A runtime keeps at most
  ``RuntimeConfig.max_warm_workers``; beyond that the least recently used
  idle one is closed.
* **One call at a time per worker** (a :class:`trio.Lock`): ``main`` runs on
  the worker's main thread, as it would cold.  Concurrency comes from more
  runtimes (the pool), not from threads in a worker.
* **Per-call env is applied**, never dropped: the worker sets it in
  ``os.environ`` for the call and restores the whole environment after
  (``argv``, the current directory and ``sys.argv`` too).  Libraries that
  read the environment *at import time* saw the worker's start environment
  (the runtime's own), not the call's: pass such settings in
  ``RuntimeConfig.env``, or run cold.
* **Failure is loud.** A worker that dies mid-call is reaped and the call
  raises :class:`WarmWorkerCrashed`; the next call starts a fresh worker.  A
  cancelled or timed-out call kills the worker (its state is unknown), so
  cancellation never leaves a busy worker or an orphan behind.
* **A changed script is re-imported**: a worker is tied to the script file's
  identity (inode, size, mtime) and replaced when it changes; ``reset``
  closes the workers of scripts that lived in the cleared workdir.
* The worker's stderr goes to a file in the runtime's state directory, kept
  under 1 MiB by the worker; its tail is quoted in crash errors.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import orjson
import trio

from lowwater.framing import MAX_LENGTH, FrameDecoder, FrameError, encode_frame, receive_object
from lowwater.runtime.base import (
    OutputLimitExceeded,
    ProgramTimeout,
    RuntimeConfig,
    RuntimeStateError,
    ScriptError,
    WarmWorkerCrashed,
)
from lowwater.runtime.process import kill_group, reap

WORKER_SCRIPT = Path(__file__).with_name("_warm_worker.py")
#: The worker truncates its stderr file beyond this (bytes).
STDERR_CAP_BYTES = 1 << 20
#: How much of the stderr file a crash error quotes (bytes).
STDERR_TAIL_BYTES = 4096
#: Room in a reply frame for the JSON envelope and a traceback (bytes).
FRAME_SLACK_BYTES = 1 << 20


class _Protocol(Exception):
    """The worker's pipe closed or it sent a malformed frame."""


class _Retired(Exception):
    """The worker was closed while this call waited for it."""


def _signature(script: str) -> tuple[int, int, int, int]:
    st = os.stat(script)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class WarmWorker:
    """One worker process for one script, started on first call.

    Args:
        script: absolute path of the script.
        command: how to start a Python, e.g. ``[sys.executable]``; plugin
            runtimes can prefix it (``["docker", "exec", "-i", ID, "python"]``).
        env: the worker's environment (already filtered).
        cwd: its working directory.
        stderr_path: file that receives its stderr (truncated at each start).
        max_output_bytes: cap on a call's result (bytes).
        start_timeout_s: how long the import may take (seconds).
    """

    def __init__(
        self,
        script: str,
        *,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        stderr_path: Path,
        max_output_bytes: int,
        start_timeout_s: float,
    ) -> None:
        self.script = script
        self.command = list(command)
        self.env = dict(env)
        self.cwd = cwd
        self.stderr_path = stderr_path
        self.max_output_bytes = max_output_bytes
        self.start_timeout_s = start_timeout_s
        self.signature: tuple[int, int, int, int] | None = None
        self.calls = 0
        self.starts = 0
        self.crashes = 0
        self._proc: trio.Process | None = None
        self._frames = FrameDecoder()
        self._lock = trio.Lock()
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The worker's pid, or ``None`` when it is not running."""
        return None if self._proc is None else self._proc.pid

    @property
    def busy(self) -> bool:
        """A call holds the worker."""
        return self._lock.locked()

    async def call(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> str:
        """Call the script's ``main(argv)``; its result.

        Raises:
            ScriptError: ``main`` raised, or the import failed.
            OutputLimitExceeded: the result exceeded ``max_output_bytes``.
            WarmWorkerCrashed: the worker died or could not start.
            ProgramTimeout: ``timeout`` (seconds, import excluded) expired;
                the worker was killed.
        """
        # Bounded by the worker (MAX_REQUEST_BYTES: it exits, and the call
        # fails as a crash), as before the codec was shared.
        request = encode_frame(
            orjson.dumps({"argv": list(argv), "env": dict(env) if env else None}), max_frame=MAX_LENGTH
        )
        async with self._lock:
            if self._closed:
                raise _Retired
            if self._proc is None:
                await self._start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None  # started with stdin=PIPE
            done = False
            try:
                with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
                    await proc.stdin.send_all(request)
                    reply = await self._recv(proc, self.max_output_bytes * 6 + FRAME_SLACK_BYTES)
                if scope.cancelled_caught:
                    raise ProgramTimeout(
                        f"warm call to {os.path.basename(self.script)} killed after {timeout} s",
                        timeout_s=float(timeout or 0.0),
                    )
                done = True
            except (_Protocol, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise await self._crashed(proc, exc) from None
            finally:
                if not done:  # cancelled, timed out or broken: the worker's state is unknown
                    await self._kill(proc)
        self.calls += 1
        return self._result(reply)

    def _result(self, reply: dict) -> str:
        if reply.get("ok") is True and isinstance(reply.get("result"), str):
            return reply["result"]
        exc_type = str(reply.get("type", "Error"))
        message = str(reply.get("message", ""))
        name = os.path.basename(self.script)
        if exc_type == "OutputLimitExceeded":
            raise OutputLimitExceeded(f"script {name}: {message}")
        raise ScriptError(
            f"script {name}: main raised {exc_type}: {message}"[:1000],
            exc_type=exc_type,
            traceback=str(reply.get("traceback", "")),
        )

    async def _start(self) -> None:
        self.signature = _signature(self.script)
        stderr_fd = await trio.to_thread.run_sync(
            lambda: os.open(self.stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        )
        try:
            argv = [
                *self.command,
                "-I",
                str(WORKER_SCRIPT),
                self.script,
                str(self.max_output_bytes),
                str(STDERR_CAP_BYTES),
            ]
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr_fd,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
            )
        except OSError as exc:
            raise WarmWorkerCrashed(f"cannot start a warm worker for {self.script}: {exc}") from exc
        finally:
            os.close(stderr_fd)
        self.starts += 1
        self._frames.clear()
        ready = False
        try:
            with trio.move_on_after(self.start_timeout_s) as scope:
                hello = await self._recv(proc, FRAME_SLACK_BYTES)
            if scope.cancelled_caught:
                raise WarmWorkerCrashed(
                    f"warm worker for {os.path.basename(self.script)} did not start within {self.start_timeout_s} s",
                    stderr_tail=await self._stderr_tail(),
                )
            if hello.get("ready") is not True:
                raise ScriptError(
                    f"script {os.path.basename(self.script)} failed to import: {hello.get('type')}: {hello.get('message')}"[
                        :1000
                    ],
                    exc_type=str(hello.get("type", "ImportError")),
                    traceback=str(hello.get("traceback", "")),
                )
            ready = True
            self._proc = proc
        except (_Protocol, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise await self._crashed(proc, exc, starting=True) from None
        finally:
            if not ready:
                await self._kill(proc)

    async def _recv(self, proc: trio.Process, limit: int) -> dict:
        """One frame from the worker, decoded.

        Raises:
            _Protocol: end of stream, a frame over ``limit`` bytes, or
                invalid JSON.
        """
        assert proc.stdout is not None  # started with stdout=PIPE
        try:
            obj = await receive_object(proc.stdout, self._frames, min(limit, MAX_LENGTH))
        except FrameError as exc:
            raise _Protocol(str(exc)) from None
        if obj is None:
            raise _Protocol("the worker closed its output")
        return obj

    async def _crashed(self, proc: trio.Process, exc: BaseException, *, starting: bool = False) -> WarmWorkerCrashed:
        await self._kill(proc)
        self.crashes += 1
        tail = await self._stderr_tail()
        when = "while starting" if starting else "during a call"
        code = proc.returncode
        how = f"exit status {code}" if code is None or code >= 0 else f"signal {-code}"
        last = tail.strip().splitlines()[-1][-300:] if tail.strip() else str(exc)
        return WarmWorkerCrashed(
            f"warm worker for {os.path.basename(self.script)} died {when} ({how}): {last}",
            returncode=code,
            stderr_tail=tail,
        )

    async def _stderr_tail(self) -> str:
        def read() -> str:
            try:
                with open(self.stderr_path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - STDERR_TAIL_BYTES))
                    return f.read().decode("utf-8", errors="replace")
            except OSError:
                return ""

        with trio.CancelScope(shield=True):
            tail = await trio.to_thread.run_sync(read)
        return tail

    async def _kill(self, proc: trio.Process) -> None:
        """Kill ``proc``'s process group and reap it (shielded)."""
        if self._proc is proc:
            self._proc = None
            self._frames.clear()
        await reap(proc)

    async def aclose(self) -> None:
        """Kill the worker now (an in-flight call fails with
        :class:`WarmWorkerCrashed`).  Idempotent; shielded."""
        self._closed = True
        if self._proc is not None:
            kill_group(self._proc.pid)
            await self._kill(self._proc)


class WarmWorkers:
    """A runtime's warm workers, keyed by the script's real path.

    Args:
        config: the runtime's config (``python``, ``max_output_bytes``,
            ``warm_start_timeout_s``, ``max_warm_workers``).
        cwd: the workers' working directory (the runtime's workdir).
        state_dir: where workers' stderr files go (not cleared by reset).
        env: the workers' environment, or a callable returning it (read at
            each worker start).
        command: how to start Python (default ``[config.python]``).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        cwd: Path,
        state_dir: Path,
        env: Mapping[str, str] | Callable[[], Mapping[str, str]],
        command: Sequence[str] | None = None,
    ) -> None:
        self.config = config
        self.cwd = cwd
        self.state_dir = state_dir
        self._env = env
        self.command = list(command) if command is not None else [config.python]
        self._workers: OrderedDict[str, WarmWorker] = OrderedDict()
        self._serial = 0
        self._closed = False
        self.retired = 0

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, script: str | os.PathLike[str]) -> WarmWorker | None:
        """The worker for ``script``, if one exists."""
        return self._workers.get(os.path.realpath(script))

    def stats(self) -> dict[str, int]:
        """``workers``, ``running`` (processes alive), ``calls``, ``starts``,
        ``crashes`` of current workers, and ``retired`` workers."""
        ws = list(self._workers.values())
        return {
            "workers": len(ws),
            "running": sum(w.pid is not None for w in ws),
            "calls": sum(w.calls for w in ws),
            "starts": sum(w.starts for w in ws),
            "crashes": sum(w.crashes for w in ws),
            "retired": self.retired,
        }

    async def call(
        self,
        script: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> str:
        """Call ``main(argv)`` of ``script`` in its warm worker (see
        :meth:`WarmWorker.call` for errors).

        Raises:
            ScriptError: also when ``script`` does not exist.
            RuntimeStateError: the workers were closed.
        """
        path = os.path.realpath(script)
        while True:
            if self._closed:
                raise RuntimeStateError("runtime is stopped")
            try:
                # A local stat: microseconds, not worth a thread hop per call.
                sig = _signature(path)
            except OSError as exc:
                raise ScriptError(f"script {script}: {exc}", exc_type=type(exc).__name__) from None
            worker = self._workers.get(path)
            if worker is not None and worker.signature is not None and worker.signature != sig:
                await self._retire(path, worker)  # the file changed: import it afresh
                continue  # look again: another call may have started its successor
            if worker is None:
                worker = self._new(path)
                await self._evict_over_cap(keep=worker)
            elif self._workers.get(path) is worker:
                self._workers.move_to_end(path)  # most recently used last
            try:
                return await worker.call(argv, env, timeout)
            except _Retired:
                continue  # closed while we waited for it; take the current one

    def _new(self, path: str) -> WarmWorker:
        self._serial += 1
        worker = WarmWorker(
            path,
            command=self.command,
            env=self._env() if callable(self._env) else self._env,
            cwd=self.cwd,
            stderr_path=self.state_dir / f"warm-{self._serial}.stderr",
            max_output_bytes=self.config.max_output_bytes,
            start_timeout_s=self.config.warm_start_timeout_s,
        )
        self._workers[path] = worker
        return worker

    async def _evict_over_cap(self, keep: WarmWorker) -> None:
        """Close the least recently used idle workers beyond ``max_warm_workers``."""
        excess = len(self._workers) - self.config.max_warm_workers
        victims: list[str] = []
        for path, worker in self._workers.items():
            if len(victims) >= excess:
                break
            if worker is not keep and not worker.busy:
                victims.append(path)
        # Unlinked before any await, so no other call can pick them up.
        closing = [self._workers.pop(path) for path in victims]
        self.retired += len(closing)
        for worker in closing:
            await worker.aclose()

    async def _retire(self, path: str, worker: WarmWorker) -> None:
        if self._workers.get(path) is worker:
            del self._workers[path]
            self.retired += 1
        await worker.aclose()

    async def close_under(self, directory: Path) -> None:
        """Close the workers of scripts inside ``directory`` (shielded)."""
        prefix = os.path.join(os.path.realpath(directory), "")
        for path, worker in list(self._workers.items()):
            if path.startswith(prefix):
                await self._retire(path, worker)

    async def aclose(self) -> None:
        """Kill every worker and reap it.  Idempotent; shielded."""
        self._closed = True
        with trio.CancelScope(shield=True):
            for path, worker in list(self._workers.items()):
                await self._retire(path, worker)


__all__ = ["WORKER_SCRIPT", "WarmWorker", "WarmWorkers"]
