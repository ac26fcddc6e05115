"""The runtime contract: :class:`Runtime`, its config, its results and its errors.

A runtime is where agent programs and scoring scripts execute (docs/design.md#vocabulary).  The built-in one runs local subprocesses
(:mod:`lowwater.runtime.subprocess`); containers and remote sandboxes are
plugins that register a factory through ``register_runtimes``.  A runtime is
**single-use**: ``start`` -> any number of ``run``/``run_script``/``reset``
-> ``stop``; it cannot be started again after ``stop``.  Persistent runtimes
are reused across rollouts by :class:`lowwater.runtime.pool.RuntimePool`,
which resets them between uses and replaces the ones that fail
:meth:`Runtime.healthy`.

Output is ``bytes``: a program's output is whatever it wrote, capped at
``RuntimeConfig.max_output_bytes`` per stream (the head of stdout, the tail
of stderr; the rest is read and dropped, so the program never blocks on a
full pipe, and the result says it was truncated).  :meth:`Runtime.run_script` returns ``str``: a script's result
is text by contract (UTF-8).
"""

from __future__ import annotations

import abc
import fnmatch
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from lowwater import _validate as v
from lowwater._native import LowwaterError

MIB = 1 << 20

#: Host variables a program inherits (fnmatch patterns, case-sensitive): what
#: a program needs to run and format text, nothing that carries a credential.
#: A deny-list passed LOWWATER_ADMIN_KEY, AWS_ACCESS_KEY_ID, DATABASE_URL,
#: OPENAI_KEY, GITHUB_PAT and SSH_AUTH_SOCK to the agent under evaluation; an
#: allow-list cannot miss a name it never heard of.  More with ``pass_env``.
DEFAULT_ENV_ALLOW = ("PATH", "HOME", "LANG", "LANGUAGE", "LC_*", "TMPDIR", "TZ")
#: Never inherited, even when ``pass_env`` names them: the key that lets a
#: process set rewards and close other rollouts must not reach an agent.
NEVER_INHERITED = frozenset({"LOWWATER_ADMIN_KEY"})


# --- errors -----------------------------------------------------------------


class RuntimeFailure(LowwaterError):
    """Base class of every error a runtime or the runtime pool raises."""


class RuntimeStartError(RuntimeFailure):
    """A runtime could not be provisioned (factory, ``start`` or pool).

    The engine records it on the rollout as an ``infra`` error.
    """


class PoolClosed(RuntimeStartError):
    """:meth:`RuntimePool.acquire` after :meth:`RuntimePool.aclose`."""


class RuntimeStateError(RuntimeFailure):
    """A call the runtime's state does not allow (run before ``start``,
    ``start`` twice, anything after ``stop``)."""


class ProgramTimeout(RuntimeFailure, trio.TooSlowError):
    """A program or warm call outlived its ``timeout``; it was killed.

    A :class:`trio.TooSlowError` too, so the engine classifies it as
    ``timeout`` like any other deadline.

    Attributes:
        timeout_s: the timeout that expired (seconds).
        result: the killed program's partial :class:`ProgramResult` (cold
            runs), or ``None`` (warm calls).
    """

    def __init__(self, message: str, *, timeout_s: float, result: ProgramResult | None = None) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s
        self.result = result


class ScriptError(RuntimeFailure):
    """A script failed: ``main`` raised (warm; ``SystemExit`` included), the
    script could not be imported, or a cold run exited non-zero.

    Attributes:
        exc_type: the exception's class name (``"SystemExit"``, ...), or
            ``"ExitStatus"`` for a cold run that exited non-zero.
        traceback: the traceback text (warm), or the stderr text (cold).
        exit_code: a cold run's exit code; ``None`` for warm calls.
    """

    def __init__(self, message: str, *, exc_type: str, traceback: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.traceback = traceback
        self.exit_code = exit_code


class OutputLimitExceeded(RuntimeFailure):
    """A script's result was larger than ``RuntimeConfig.max_output_bytes``."""


class WarmWorkerCrashed(RuntimeFailure):
    """A warm worker died during a call or during its start (``os._exit``,
    a signal, a closed pipe, a malformed reply).  The worker has been reaped;
    the next call starts a fresh one.

    Attributes:
        returncode: the worker's exit status (negative: killed by that
            signal), or ``None`` if it was unknown.
        stderr_tail: the last few KiB the worker wrote to stderr.
    """

    def __init__(self, message: str, *, returncode: int | None = None, stderr_tail: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


# --- config and results -----------------------------------------------------


def _pairs(value: Mapping[str, Any] | Sequence[tuple[str, Any]] | None) -> tuple[tuple[str, Any], ...]:
    """A mapping (or pairs) as a sorted tuple of pairs: hashable, order-free."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))


def _positive(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value!r}")


@attrs.frozen
class RuntimeConfig:
    """How to provision a runtime.  Frozen and hashable: the runtime pool
    keys its runtimes by :meth:`resolved` configs.

    Attributes:
        kind: the runtime's registered name (``register_runtimes``).
        persistent: take runtimes from a :class:`RuntimePool` (reset between
            uses) instead of starting one per rollout.
        python: the interpreter for scripts and warm workers.
        env: variables set for every program (a mapping; stored as sorted
            pairs).
        inherit_env: pass the host variables that match
            :data:`DEFAULT_ENV_ALLOW` or ``pass_env``; ``False``: none.
        pass_env: more host variables to pass (names or fnmatch patterns,
            case-sensitive; ``lowwater eval --pass-env NAME``).  Credentials
            stay on the host unless named here, set in ``env`` or passed in
            a call's ``env``; ``LOWWATER_ADMIN_KEY`` is never inherited.
        max_output_bytes: cap per output stream of a program, and on a
            script's result (bytes).
        root: parent directory of runtimes' temporary directories
            (``None``: the system temp directory).
        warm_start_timeout_s: how long a warm worker may take to import its
            script before the call fails with :class:`WarmWorkerCrashed`.
        max_warm_workers: warm workers a runtime keeps (one per script);
            the least recently used idle one is closed beyond this.
        options: runtime-specific settings for plugin runtimes (a mapping;
            stored as sorted pairs; values must be hashable).
    """

    kind: str = "subprocess"
    persistent: bool = False
    python: str = attrs.field(factory=lambda: sys.executable)
    env: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_pairs)
    inherit_env: bool = True
    pass_env: tuple[str, ...] = attrs.field(default=(), converter=v.str_tuple)
    max_output_bytes: int = attrs.field(default=MIB, validator=_positive)
    root: str | None = None
    warm_start_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    max_warm_workers: int = attrs.field(default=4, validator=_positive)
    options: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_pairs)

    def option(self, name: str, default: Any = None) -> Any:
        """The value of ``options[name]``, or ``default``."""
        return dict(self.options).get(name, default)

    def resolved(self) -> RuntimeConfig:
        """This config with ``python`` and ``root`` made absolute, so that two
        spellings of the same runtime share one pool key.

        Raises:
            RuntimeStartError: ``python`` is not an executable on ``PATH``.
        """
        python = self.python
        if os.sep not in python:
            import shutil

            found = shutil.which(python)
            if found is None:
                raise RuntimeStartError(f"python interpreter {python!r} not found on PATH")
            python = found
        root = None if self.root is None else os.path.abspath(self.root)
        return attrs.evolve(self, python=os.path.abspath(python), root=root)


def build_env(config: RuntimeConfig, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a program gets: the host variables allowed by
    :data:`DEFAULT_ENV_ALLOW` and ``config.pass_env`` (if ``inherit_env``;
    never :data:`NEVER_INHERITED`), then ``config.env``, then ``env`` (last wins).

    Raises:
        TypeError: a key or value in ``env`` is not a ``str``.
    """
    out: dict[str, str] = {}
    if config.inherit_env:
        allow = (*DEFAULT_ENV_ALLOW, *config.pass_env)
        out = {
            k: v
            for k, v in os.environ.items()
            if k not in NEVER_INHERITED and any(fnmatch.fnmatchcase(k, p) for p in allow)
        }
    out.update(config.env)
    if env:
        for k, v in env.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"env entries must be str -> str, not {k!r}: {v!r}")
            out[k] = v
    return out


@attrs.frozen
class ProgramResult:
    """What a finished program left behind.

    Attributes:
        exit_code: the exit status; negative ``-N`` when killed by signal N.
        stdout: standard output: its first ``max_output_bytes`` bytes.
        stderr: standard error: its last ``max_output_bytes`` bytes (the
            end is where a traceback's message is).
        duration_s: wall time from spawn to exit (seconds).
        stdout_truncated: the program wrote more than the cap to stdout.
        stderr_truncated: the same for stderr.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0."""
        return self.exit_code == 0

    @property
    def stdout_text(self) -> str:
        """``stdout`` decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        """``stderr`` decoded as UTF-8 (invalid bytes replaced)."""
        return self.stderr.decode("utf-8", errors="replace")


# --- the base class ---------------------------------------------------------


class Runtime(abc.ABC):
    """Base class of runtimes.  Subclasses implement ``start``, ``stop``,
    ``reset``, ``run`` and ``workdir``; ``run_script`` has a cold default
    built on ``run``, and ``healthy`` a default that checks the state.

    Also an async context manager: ``async with rt:`` starts and stops it.

    Args:
        config: the runtime's config (already resolved by the pool).
    """

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config

    @property
    @abc.abstractmethod
    def workdir(self) -> Path:
        """The working directory programs start in (absolute).

        Raises:
            RuntimeStateError: the runtime is not started, or stopped.
        """

    @abc.abstractmethod
    async def start(self) -> None:
        """Provision the runtime.

        Raises:
            RuntimeStartError: provisioning failed (nothing is left behind).
            RuntimeStateError: already started or stopped.
        """

    @abc.abstractmethod
    async def stop(self) -> None:
        """Kill everything the runtime runs and remove its directories.
        Idempotent; a no-op on a runtime that was never started."""

    @abc.abstractmethod
    async def reset(self) -> None:
        """Clear the workspace for the next user (the workdir stays, empty).

        Raises:
            RuntimeStateError: not started, or stopped.
        """

    @abc.abstractmethod
    async def run(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> ProgramResult:
        """Run ``argv`` in :attr:`workdir` and wait for it.

        Args:
            argv: program and arguments (no shell).
            env: variables added to the runtime's environment for this run
                (they may include credentials: explicit is allowed).
            timeout: seconds before the program (and everything it started)
                is killed; ``None``: no limit.

        Raises:
            ProgramTimeout: ``timeout`` expired (``.result`` has the partial
                output).
            RuntimeStateError: not started, or stopped.
            OSError: the program could not be spawned.
        """

    async def run_script(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        warm: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Run a script exposing ``main(argv: list[str]) -> str``; its result.

        Cold (and this default for runtimes without warm workers, where
        ``warm`` changes speed, never the result): ``python script args``,
        whose standard output is the result, so a script ends with
        ``if __name__ == "__main__": sys.stdout.write(main(sys.argv[1:]))``.

        Raises:
            ScriptError: non-zero exit (``.traceback`` has stderr).
            OutputLimitExceeded: the output exceeded ``max_output_bytes``.
            ProgramTimeout: ``timeout`` expired.
            RuntimeStateError: not started, or stopped.
        """
        return await self._run_script_cold(script, args, env=env, timeout=timeout)

    async def _run_script_cold(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None,
        timeout: float | None,
    ) -> str:
        result = await self.run([self.config.python, os.fspath(script), *args], env=env, timeout=timeout)
        return script_output(script, result, self.config.max_output_bytes)

    async def healthy(self) -> bool:
        """True if the runtime can take another user.  The pool calls it
        after ``reset`` and before handing out an idle runtime; a runtime
        that answers False is stopped and replaced.  Must not raise."""
        return True

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with trio.CancelScope(shield=True):
            await self.stop()


def script_output(script: str | os.PathLike[str], result: ProgramResult, limit: int) -> str:
    """A cold script run's result text, or the error it amounts to.

    Raises:
        ScriptError: non-zero exit, or stdout that is not UTF-8.
        OutputLimitExceeded: stdout was truncated.
    """
    name = os.path.basename(os.fspath(script))
    if result.exit_code != 0:
        stderr = result.stderr_text
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        raise ScriptError(
            f"script {name} exited {result.exit_code}: {last[-300:]}",
            exc_type="ExitStatus",
            traceback=stderr,
            exit_code=result.exit_code,
        )
    if result.stdout_truncated:
        raise OutputLimitExceeded(f"script {name} wrote more than {limit} bytes")
    try:
        return result.stdout.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScriptError(f"script {name} wrote non-UTF-8 output: {exc}", exc_type="UnicodeDecodeError") from None
