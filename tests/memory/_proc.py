"""Helpers of the RSS gates: real subprocesses, their current RSS, and bounded waits.

Every wait has a deadline (a stuck process fails the test with what it was
waiting for instead of hanging CI); no helper asserts how long anything took.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
HERE = Path(__file__).resolve().parent
#: Deadline of one wait (seconds): generous for a loaded 2-core CI machine.
WAIT_S = 120.0


def rss_of(pid: int) -> int:
    """Current resident set size of process ``pid`` in bytes (``/proc/PID/statm``, not a peak).

    Raises:
        FileNotFoundError: the process is gone.
    """
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S, poll_s: float = 0.1) -> Any:
    """Poll ``check()`` until it returns something truthy; returns it.

    Raises:
        AssertionError: still falsy after ``timeout_s`` (names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(poll_s)


def end_input_and_wait(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop a child driven over its stdin: close the stdin (its end of
    input: the child cleans up and exits), wait, kill it past ``timeout_s``;
    then close its stdout pipe."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
    proc.stdout.close()


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment for a child, without allocator overrides that would change what is measured."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONMALLOC", "LD_PRELOAD", "MALLOC_ARENA_MAX")}
    env.update(extra)
    return env


class Child:
    """A subprocess whose stderr goes to a file (a full pipe must never block it).

    Args:
        argv: the command; ``sys.executable`` is prepended when it starts with ``-m`` or a ``.py`` path.
        log: file for its stderr (stdout too unless ``stdout_pipe``).
        stdout_pipe: keep stdout as a pipe (for servers that print their URL there).
    """

    def __init__(
        self, argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None, stdout_pipe: bool = False
    ) -> None:
        argv = list(argv)
        if argv[0] == "-m" or argv[0].endswith(".py"):
            argv.insert(0, sys.executable)
        self.log = log
        self._log_file = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else self._log_file,
            stderr=self._log_file,
            env=env if env is not None else child_env(),
        )
        self.pid = self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, pattern: str, what: str) -> re.Match[str]:
        """The first match of ``pattern`` in the child's log, waiting for it.

        Raises:
            AssertionError: the child exited first, or no match before the deadline.
        """

        def found() -> re.Match[str] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: the child exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
            return re.search(pattern, self.text())

        return wait_until(found, what)

    def rss(self) -> int:
        assert self.proc.poll() is None, f"the child exited with {self.proc.returncode}:\n{self.text()[-4000:]}"
        return rss_of(self.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()


def serve_model(tmp_path: Path, *extra: str) -> tuple[Child, str]:
    """``lowwater serve-model --scripted`` in a subprocess; returns it and its base URL (ending ``/v1``)."""
    child = Child(
        ["-m", "lowwater", "serve-model", "--scripted", *extra], tmp_path / "serve-model.log", stdout_pipe=True
    )
    line = child.proc.stdout.readline().decode().strip()  # the server prints its URL first
    assert line.startswith("http://"), f"serve-model printed {line!r}:\n{child.text()}"
    return child, line + "/v1"
