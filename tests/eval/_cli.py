"""``lowwater`` as a command in the eval tests: run it, start an eval in the
background, and read the results file it writes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lowwater.eval.results import read_rows

LOWWATER = [sys.executable, "-m", "lowwater"]


def lowwater(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``lowwater ARGS`` in ``cwd``, output captured as text; ``TimeoutExpired`` after ``timeout`` s."""
    return subprocess.run([*LOWWATER, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def start_eval(*args: str, out: Path, cwd: Path, **popen: Any) -> subprocess.Popen:
    """``lowwater eval ARGS --out OUT --no-progress`` started in ``cwd``; ``popen``
    goes to ``subprocess.Popen`` (where its output goes, a new session)."""
    return subprocess.Popen([*LOWWATER, "eval", *args, "--out", str(out), "--no-progress"], cwd=cwd, **popen)


def wait_for_lines(path: Path, lines: int, timeout_s: float = 120) -> None:
    """Poll until ``path`` holds ``lines`` lines (header included) or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= lines:
            return
        time.sleep(0.05)


def rows_of(path: Path) -> list[dict]:
    """The rows of the results file ``path``, which must have its header and no torn line."""
    header, rows, torn = read_rows(path)
    assert header is not None and not torn
    return rows
