"""Process helpers shared by the runtime tests: what a runtime left alive."""

from __future__ import annotations

import time

import psutil

#: multiprocessing's forkserver and resource tracker: one per process, started
#: by an earlier test's WorkerPool (tests/eval, tests/engine, tests/workers)
#: and alive until pytest exits, by design; not something a runtime left behind.
_MP_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _mp_helper(p: psutil.Process) -> bool:
    return any(helper in arg for arg in p.cmdline() for helper in _MP_HELPERS)


def live_children(expect: int = 0, settle_s: float = 10.0) -> list[psutil.Process]:
    """Non-zombie descendants of this process, multiprocessing's helpers
    excepted.  SIGKILL is asynchronous for processes nobody reaps at once
    (grandchildren), so wait up to ``settle_s`` for their number to reach
    ``expect`` before reporting (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + settle_s
    while True:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and not _mp_helper(p):
                    out.append(p)
            except psutil.Error:  # gone, or a zombie whose cmdline cannot be read
                pass
        if len(out) == expect or time.monotonic() > deadline:
            return out
        time.sleep(0.01)
