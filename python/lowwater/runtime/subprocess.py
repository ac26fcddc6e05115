"""The built-in runtime: local subprocesses in a private temporary directory.

Isolation it gives (and what it does not):

* a temporary directory per runtime, removed by ``stop``; programs start in
  its ``work/`` subdirectory (``workdir``), which ``reset`` empties;
* each program in its own session and process group
  (``start_new_session=True``): a timeout, a cancellation or the program's
  own exit kills the whole group with ``SIGKILL``, so no grandchild outlives
  the call.  A program that leaves its group (``setsid``) escapes that; use a
  container runtime for untrusted code;
* an environment without the host's credentials (an allow-list, ``RuntimeConfig.pass_env``)
  unless passed explicitly;
* output capped per stream (``RuntimeConfig.max_output_bytes``): the first
  bytes of stdout, the last bytes of stderr (where a traceback ends);
* warm workers (:mod:`lowwater.runtime.warm`), one per script.

Nothing here blocks the Trio loop: processes come from
``trio.lowlevel.open_process``, directories are created and removed in
``trio.to_thread``.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import trio

from lowwater.runtime.base import (
    ProgramResult,
    ProgramTimeout,
    Runtime,
    RuntimeConfig,
    RuntimeStartError,
    RuntimeStateError,
    build_env,
)
from lowwater.runtime.process import PIPE_GRACE_S, Capped, kill_group, reap, wait_exited
from lowwater.runtime.warm import WarmWorkers


class SubprocessRuntime(Runtime):
    """Local subprocesses in a private temporary directory (see the module doc).

    Args:
        config: the runtime's config; ``kind`` is not checked here.
    """

    #: ``--runtime-option`` keys it takes: none, so a typo is refused rather
    #: than silently ignored (:mod:`lowwater.runtime_choice`).
    options: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        super().__init__(config if config is not None else RuntimeConfig())
        self._root: Path | None = None
        self._workdir: Path | None = None
        self._stopped = False
        self._warm: WarmWorkers | None = None

    # -- state ---------------------------------------------------------------

    @property
    def workdir(self) -> Path:
        if self._workdir is None or self._stopped:
            raise RuntimeStateError("runtime is not started" if not self._stopped else "runtime is stopped")
        return self._workdir

    @property
    def warm_workers(self) -> WarmWorkers | None:
        """The runtime's warm workers (``None`` until started)."""
        return self._warm

    def _check(self) -> Path:
        return self.workdir

    async def start(self) -> None:
        """Create the runtime's temporary directory.

        Raises:
            RuntimeStartError: the directory could not be created.
            RuntimeStateError: already started, or stopped.
        """
        if self._stopped:
            raise RuntimeStateError("runtime is stopped; start a new one")
        if self._root is not None:
            raise RuntimeStateError("runtime is already started")
        try:
            root = Path(
                await trio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="lowwater-rt-", dir=self.config.root))
            )
        except OSError as exc:
            raise RuntimeStartError(f"cannot create runtime directory: {exc}") from exc
        self._root = root
        try:
            await trio.to_thread.run_sync(_make_dirs, root)
        except BaseException as exc:
            await trio.to_thread.run_sync(shutil.rmtree, root, True)
            self._root = None
            if isinstance(exc, OSError):
                raise RuntimeStartError(f"cannot create runtime directory: {exc}") from exc
            raise

        self._workdir = root / "work"
        self._warm = WarmWorkers(
            self.config,
            cwd=self._workdir,
            state_dir=root / "state",
            env=lambda: build_env(self.config),
        )

    async def stop(self) -> None:
        """Kill the warm workers and remove the directory.  Idempotent.

        Programs started by ``run`` are already dead (each call kills its own
        group before returning).  Shielded: it finishes under cancellation.
        """
        if self._stopped:
            return
        self._stopped = True
        with trio.CancelScope(shield=True):
            if self._warm is not None:
                await self._warm.aclose()
            if self._root is not None:
                await trio.to_thread.run_sync(shutil.rmtree, self._root, True)

    async def reset(self) -> None:
        """Empty the workdir (it keeps its path, so warm workers, whose
        current directory it is, stay valid) and close warm workers whose
        script lived in it.

        Raises:
            RuntimeStateError: not started, or stopped.
        """
        workdir = self._check()
        assert self._warm is not None
        await self._warm.close_under(workdir)
        await trio.to_thread.run_sync(_empty_dir, workdir)

    async def healthy(self) -> bool:
        """Started, not stopped, and the workdir still exists."""
        if self._workdir is None or self._stopped:
            return False
        return await trio.to_thread.run_sync(os.path.isdir, self._workdir)

    # -- programs ------------------------------------------------------------

    async def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> ProgramResult:
        """Run ``argv`` in :attr:`workdir` (see :meth:`Runtime.run`).

        Stdin is ``/dev/null``.  When the program exits, its process group is
        killed (background children it left behind die with it); on timeout or
        cancellation the group is killed first.  Always reaped, never orphaned.

        Raises:
            ProgramTimeout: ``timeout`` expired; ``.result`` holds the output
                read so far and the kill's exit code.
            RuntimeStateError: not started, or stopped.
            OSError: the program could not be spawned (``FileNotFoundError``
                for a missing executable).
            ValueError: ``argv`` is empty.
        """
        cwd = self._check()
        if not argv:
            raise ValueError("argv must name a program")
        full_env = build_env(self.config, env)
        limit = self.config.max_output_bytes
        started = time.monotonic()
        proc = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=full_env,
            start_new_session=True,
        )
        out, err = Capped(limit), Capped(limit, tail=True)
        out_done, err_done = trio.Event(), trio.Event()
        timed_out = False
        assert proc.stdout is not None and proc.stderr is not None  # opened with PIPE above
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(out.drain, proc.stdout, out_done)
                nursery.start_soon(err.drain, proc.stderr, err_done)
                with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
                    await wait_exited(proc)
                timed_out = scope.cancelled_caught
                kill_group(proc.pid)
                with trio.move_on_after(PIPE_GRACE_S):
                    await out_done.wait()
                    await err_done.wait()
                nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                exit_code = await proc.wait()
        finally:
            await reap(proc)
        result = ProgramResult(
            exit_code=exit_code,
            stdout=out.value(),
            stderr=err.value(),
            duration_s=time.monotonic() - started,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
        )
        if timed_out:
            raise ProgramTimeout(f"{argv[0]} killed after {timeout} s", timeout_s=float(timeout or 0.0), result=result)
        return result

    async def run_script(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        warm: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Run ``script``'s ``main(argv) -> str`` (see :meth:`Runtime.run_script`).

        ``warm=True`` sends the call to this runtime's warm worker for the
        script (started on first use, kept across ``reset``): ``env`` is
        applied to ``os.environ`` for the call and restored after it.  A
        warm call that is cancelled or times out kills the worker (the next
        call starts a new one).

        Raises:
            ScriptError: ``main`` raised (``SystemExit`` included), the
                script failed to import, or a cold run exited non-zero.
            WarmWorkerCrashed: the warm worker died during the call.
            OutputLimitExceeded: the result exceeded ``max_output_bytes``.
            ProgramTimeout: ``timeout`` expired.
            RuntimeStateError: not started, or stopped.
        """
        self._check()
        if not warm:
            return await self._run_script_cold(script, args, env=env, timeout=timeout)
        assert self._warm is not None
        return await self._warm.call(os.fspath(script), [str(a) for a in args], env=env, timeout=timeout)


def _empty_dir(path: Path) -> None:
    """Remove everything inside ``path`` (not ``path`` itself); blocking."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass


def _make_dirs(root: Path) -> None:
    (root / "work").mkdir()
    (root / "state").mkdir()
