"""The runtime conformance state machine, for runtime plugins' test suites.

Subclass :class:`RuntimeConformance`, set ``runtime_factory`` and collect
its ``TestCase``::

    from lowwater.testing.runtime import RuntimeConformance

    class MyRuntimeConformance(RuntimeConformance):
        runtime_factory = staticmethod(lambda: MyRuntime(RuntimeConfig(kind="mine")))

    TestMyRuntime = MyRuntimeConformance.TestCase

Hypothesis then drives random sequences of **start**, **run**, file writes,
**reset**, cold and warm ``run_script`` (with and without a per-call env),
**crash** (a program killed by a signal, a warm worker that ``os._exit``\\ s,
a script raising ``SystemExit``), timeouts, **stop** and **reuse** (a fresh
runtime from the factory after stop), and checks them against a small model:

* a runtime answers ``healthy()`` exactly while started;
* ``run``/``reset``/``run_script`` before start or after stop raise
  :class:`RuntimeStateError`; ``start`` twice, or after stop, does too;
  ``stop`` is idempotent;
* programs start in the workdir and see the files written there since the
  last ``reset`` and nothing older;
* a script's result is the same cold and warm, and a call's env is seen by
  that call only;
* a crash fails the call with the documented error and leaves the runtime
  healthy; a ``SystemExit`` in a warm script is a :class:`ScriptError`;
* after a timeout or ``stop``, no process the runtime started remains
  (:meth:`RuntimeConformance.leftover_processes`; override it for runtimes
  whose processes are not children of the test process).

The machine runs one Trio loop on a helper thread for its whole life
(:class:`lowwater.testing.background.BackgroundTrio`: a runtime's processes
and pipes belong to the loop that made them); rules call into it.
"""

from __future__ import annotations

import os
import shutil
import signal
import string
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import hypothesis.strategies as st
import psutil
import trio
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lowwater.runtime.base import (
    ProgramTimeout,
    Runtime,
    RuntimeStateError,
    ScriptError,
    WarmWorkerCrashed,
)
from lowwater.testing.background import BackgroundTrio

#: Marker put on every program the machine starts, to find leftovers.
MARKER = "lowwater-conformance-marker"
#: Suffix of the marker of the timeout rule's sleeping processes.
SLEEPER = "-sleeper"

ECHO_SCRIPT = """\
import os, sys

def main(argv):
    return "|".join(argv) + ";" + os.environ.get("LW_CONFORMANCE", "")

if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1:]))
"""

CRASH_SCRIPT = """\
import os, sys

def main(argv):
    os._exit(7)

if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1:]))
"""

EXIT_SCRIPT = """\
import sys

def main(argv):
    raise SystemExit(3)

if __name__ == "__main__":
    sys.stdout.write(main(sys.argv[1:]))
"""

_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " .-_", max_size=12)


_E = TypeVar("_E", bound=BaseException)


def _expect(exc_type: type[_E], fn: Callable[[], Any]) -> _E:
    try:
        fn()
    except exc_type as exc:
        return exc
    raise AssertionError(f"expected {exc_type}, nothing raised")


#: Environment variable naming the size of the conformance runs: ``long``
#: for soak runs (``LOWWATER_HYPOTHESIS_PROFILE=long pytest ...``; lowwater's
#: tests/conftest.py loads a Hypothesis profile of the same name for the
#: other property tests); anything else, or unset, is ``ci``.
PROFILE_ENV = "LOWWATER_HYPOTHESIS_PROFILE"
_COMMON = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
#: Settings of every subclass's ``TestCase`` by profile.  ``ci``: 10-35 s
#: per built-in runtime on a 2-core machine with other jobs running (the
#: timeout rule's waits vary with the drawn sequences); it runs the crash,
#: timeout and reuse rules 15-30 times each (8 examples of 12 steps, the
#: former size, ran them about 6 times).  ``long``: 25x the steps.
#: Assign ``Sub.TestCase.settings`` to override.
CONFORMANCE_PROFILES = {
    "ci": settings(_COMMON, max_examples=20, stateful_step_count=25),
    "long": settings(_COMMON, max_examples=200, stateful_step_count=50),
}


def conformance_settings(environ: Mapping[str, str] | None = None) -> settings:
    """The settings of the profile named by ``LOWWATER_HYPOTHESIS_PROFILE`` (``ci`` if unset or unknown)."""
    name = (os.environ if environ is None else environ).get(PROFILE_ENV, "ci")
    return CONFORMANCE_PROFILES.get(name, CONFORMANCE_PROFILES["ci"])


#: The settings subclasses get (read once, when this module is imported).
CONFORMANCE_SETTINGS = conformance_settings()


class RuntimeConformance(RuleBasedStateMachine):
    """The conformance machine; see the module doc.

    Class attributes a subclass sets:
        runtime_factory: zero-argument callable returning a new, unstarted
            :class:`Runtime` (required).
        python: the interpreter programs run with inside the runtime.
        supports_warm: False for runtimes that run warm calls cold; a
            crashing warm script then fails with :class:`ScriptError`.
        timeout_s: the short timeout used by the timeout rule (seconds).
    """

    runtime_factory: Callable[[], Runtime] | None = None
    python: str = sys.executable
    supports_warm: bool = True
    timeout_s: float = 0.5

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TestCase.settings = CONFORMANCE_SETTINGS

    def __init__(self) -> None:
        super().__init__()
        if type(self).runtime_factory is None:
            raise TypeError(f"{type(self).__name__} must set runtime_factory")
        #: Carried by every process this instance starts (see leftover_processes).
        self.marker = f"{MARKER}-{uuid.uuid4().hex[:12]}"
        self.loop = BackgroundTrio()
        self.scripts = Path(tempfile.mkdtemp(prefix=self.marker + "-"))  # warm workers' argv carries it
        for name, text in (("echo.py", ECHO_SCRIPT), ("crash.py", CRASH_SCRIPT), ("exit.py", EXIT_SCRIPT)):
            (self.scripts / name).write_text(text)
        self.runtime = self._new_runtime()
        self.state = "new"
        self.files: set[str] = set()

    def _new_runtime(self) -> Runtime:
        factory = type(self).runtime_factory
        assert factory is not None
        return factory()

    # -- hooks a subclass may override ----------------------------------------

    def leftover_processes(self, marker: str | None = None, settle_s: float = 10.0) -> list[psutil.Process]:
        """Live (non-zombie) processes of this machine instance that remain.

        By default every process on the host whose command line carries
        ``marker`` (default: this instance's :attr:`marker`, which every
        program, script path and sleeper of the machine carries).  All
        processes, not only descendants: an orphan is reparented away from
        us, and finding orphans is the point.  SIGKILL is asynchronous, so
        this polls for up to ``settle_s`` seconds for the list to drain.
        """
        marker = self.marker if marker is None else marker
        deadline = time.monotonic() + settle_s
        while True:
            found = []
            for proc in psutil.process_iter(["cmdline", "status"]):
                cmdline = proc.info["cmdline"] or []
                if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in part for part in cmdline):
                    found.append(proc)
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.01)

    # -- helpers ----------------------------------------------------------------

    def call(self, afn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def go() -> Any:
            return await afn(*args, **kwargs)

        return self.loop.run(go)

    def py(self, code: str, *args: str) -> list[str]:
        return [self.python, "-c", f"# {self.marker}\n{code}", *args]

    def listing(self) -> set[str]:
        result = self.call(self.runtime.run, self.py("import os, sys; sys.stdout.write('\\n'.join(os.listdir()))"))
        assert result.exit_code == 0, result.stderr
        return {line for line in result.stdout.decode().split("\n") if line}

    # -- rules ------------------------------------------------------------------

    @rule()
    def start(self) -> None:
        if self.state == "new":
            self.call(self.runtime.start)
            self.state = "started"
            self.files = set()
            assert self.listing() == set(), "a new runtime's workdir must be empty"
        else:
            _expect(RuntimeStateError, lambda: self.call(self.runtime.start))

    @precondition(lambda self: self.state == "started")
    @rule(payload=_TEXT)
    def run(self, payload: str) -> None:
        result = self.call(self.runtime.run, self.py("import sys; sys.stdout.write(sys.argv[1])", payload))
        assert result.exit_code == 0 and result.stdout == payload.encode(), result
        assert result.duration_s >= 0

    @precondition(lambda self: self.state != "started")
    @rule()
    def run_when_not_started(self) -> None:
        _expect(RuntimeStateError, lambda: self.call(self.runtime.run, self.py("pass")))
        _expect(RuntimeStateError, lambda: self.call(self.runtime.reset))
        _expect(RuntimeStateError, lambda: self.call(self.runtime.run_script, self.scripts / "echo.py", []))

    @precondition(lambda self: self.state == "started")
    @rule(name=st.sampled_from(["a.txt", "b.txt", "sub"]))
    def write_file(self, name: str) -> None:
        code = "import os, sys; n = sys.argv[1]\nif n == 'sub':\n    os.makedirs('sub/deeper', exist_ok=True); open('sub/deeper/f', 'w').write('x')\nelse:\n    open(n, 'w').write('x')"
        result = self.call(self.runtime.run, self.py(code, name))
        assert result.exit_code == 0, result.stderr
        self.files.add(name)
        assert self.listing() == self.files

    @precondition(lambda self: self.state == "started")
    @rule()
    def reset(self) -> None:
        self.call(self.runtime.reset)
        self.files = set()
        assert self.listing() == set(), "reset must empty the workdir"

    @precondition(lambda self: self.state == "started")
    @rule(warm=st.booleans(), args=st.lists(_TEXT, max_size=3), value=st.none() | _TEXT.filter(bool))
    def run_script(self, warm: bool, args: list[str], value: str | None) -> None:
        env = None if value is None else {"LW_CONFORMANCE": value}
        got = self.call(self.runtime.run_script, self.scripts / "echo.py", args, env=env, warm=warm)
        assert got == "|".join(args) + ";" + (value or ""), got

    @precondition(lambda self: self.state == "started")
    @rule(warm=st.booleans())
    def crash(self, warm: bool) -> None:
        if warm:
            expected = WarmWorkerCrashed if self.supports_warm else ScriptError
            _expect(expected, lambda: self.call(self.runtime.run_script, self.scripts / "crash.py", [], warm=True))
        else:
            result = self.call(self.runtime.run, self.py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
            assert result.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL), result
        assert self.call(self.runtime.healthy)
        # The next call works (a crashed worker is restarted on demand).
        assert self.call(self.runtime.run_script, self.scripts / "echo.py", ["after"], warm=warm) == "after;"

    @precondition(lambda self: self.state == "started")
    @rule(warm=st.booleans())
    def script_exits(self, warm: bool) -> None:
        exc = _expect(ScriptError, lambda: self.call(self.runtime.run_script, self.scripts / "exit.py", [], warm=warm))
        if warm and self.supports_warm:
            assert exc.exc_type == "SystemExit", exc
        assert self.call(self.runtime.run_script, self.scripts / "echo.py", ["x"], warm=warm) == "x;"

    @precondition(lambda self: self.state == "started")
    @rule()
    def timeout(self) -> None:
        # The program starts a grandchild: both must die with the timeout.
        code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]])\ntime.sleep(60)"
        exc = _expect(
            ProgramTimeout,
            lambda: self.call(self.runtime.run, self.py(code, self.marker + SLEEPER), timeout=self.timeout_s),
        )
        assert isinstance(exc, trio.TooSlowError)
        assert self.leftover_processes(self.marker + SLEEPER) == [], "a timed-out program's process tree must be gone"

    @precondition(lambda self: self.state != "new")
    @rule()
    def stop(self) -> None:
        self.call(self.runtime.stop)
        self.call(self.runtime.stop)  # idempotent
        self.state = "stopped"
        assert self.leftover_processes() == [], "stop must leave no process behind"

    @precondition(lambda self: self.state == "stopped")
    @rule()
    def reuse(self) -> None:
        """A stopped runtime stays stopped; the next user gets a fresh one."""
        _expect(RuntimeStateError, lambda: self.call(self.runtime.start))
        self.runtime = self._new_runtime()
        self.state = "new"

    @invariant()
    def healthy_exactly_while_started(self) -> None:
        assert self.call(self.runtime.healthy) == (self.state == "started")

    def teardown(self) -> None:
        try:
            self.call(self.runtime.stop)
            assert self.leftover_processes() == [], "stop must leave no process behind"
        finally:
            self.loop.close()
            shutil.rmtree(self.scripts, ignore_errors=True)


__all__ = ["CONFORMANCE_SETTINGS", "MARKER", "SLEEPER", "RuntimeConformance"]
