"""Toy jobs for the worker pool tests and benches (built in the worker from a JobSpec).

Task ids are strings ``"kind:arg:arg"`` so one job serves every scenario:

* ``"ok:N"`` — returns one row at once;
* ``"sleep:S"`` — sleeps S seconds (Trio), then returns;
* ``"leak:MB"`` — allocates MB MiB and keeps it for the worker's lifetime;
* ``"hold:MB:S"`` — allocates MB MiB, sleeps S seconds, frees it;
* ``"block:S:UNTIL"`` — blocks the loop with ``time.sleep(S)`` on attempts
  below UNTIL (a hung worker), returns at once afterwards;
* ``"hang:S:UNTIL"`` — sleeps S seconds (Trio) on attempts below UNTIL, then
  returns at once (a task that is in flight when its worker is killed);
* ``"die:UNTIL"`` — the worker SIGKILLs itself on attempts below UNTIL
  (``UNTIL=0``: always);
* ``"raise"`` — raises ValueError;
* ``"env:NAME"`` — runs a subprocess that prints the variable NAME;
* ``"arenas:T[:N]"`` — allocates from T threads and reports the arena count
  (with N: first sets ``MALLOC_ARENA_MAX=N`` in the worker's own environment);
* ``"modules"`` — reports which heavy or parent-only modules the worker has imported;
* ``"cancel-aware:S"`` — sleeps S seconds; if cancelled, returns its own row.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import trio

from lowwater.workers import WorkerJob
from lowwater.workers.allocator import arena_count

_LEAKED: list[bytes] = []


def _touch(mb: float) -> bytes:
    # b"\x01" * n writes every page, so RSS really grows (a zeroed
    # bytearray would be untouched calloc pages).
    return b"\x01" * int(mb * (1 << 20))


class ToyJob(WorkerJob):
    def __init__(self, setup_delay_s: float = 0.0, fail_setup: bool = False) -> None:
        self.setup_delay_s = setup_delay_s
        self.fail_setup = fail_setup
        self.runs = 0
        self.setups = 0

    async def setup(self) -> None:
        if self.fail_setup:
            raise RuntimeError("setup refused (test)")
        await trio.sleep(self.setup_delay_s)
        self.setups += 1

    def stats(self) -> dict[str, Any]:
        return {"runs": self.runs, "leaked_mb": len(_LEAKED) and sum(map(len, _LEAKED)) / (1 << 20)}

    def leftovers(self) -> dict[str, int]:
        # What a "leak:MB" task left behind, as an engine reports live trajectories.
        return {"leaked_buffers": len(_LEAKED)} if _LEAKED else {}

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        self.runs += 1
        kind, *args = str(task_id).split(":")
        row: dict[str, Any] = {"task_id": task_id, "attempt": attempt, "pid": os.getpid(), "error": None}
        if kind == "sleep":
            await trio.sleep(float(args[0]))
        elif kind == "leak":
            _LEAKED.append(_touch(float(args[0])))
        elif kind == "hold":
            block = _touch(float(args[0]))
            await trio.sleep(float(args[1]))
            del block
        elif kind == "block":
            if attempt < int(args[1]):
                time.sleep(float(args[0]))
        elif kind == "hang":
            if attempt < int(args[1]):
                await trio.sleep(float(args[0]))
        elif kind == "die":
            if int(args[0]) == 0 or attempt < int(args[0]):
                os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "raise":
            raise ValueError("toy failure")
        elif kind == "env":
            out = await trio.run_process(
                [sys.executable, "-c", f"import os; print(os.environ.get({args[0]!r}, ''))"], capture_stdout=True
            )
            row["value"] = out.stdout.decode().strip()
        elif kind == "arenas":
            if len(args) > 1:  # set the variable in this (already running) process first
                os.environ["MALLOC_ARENA_MAX"] = args[1]
            row["arenas"] = await trio.to_thread.run_sync(_arenas_after_threads, int(args[0]))
        elif kind == "modules":
            row["modules"] = sorted(
                m for m in sys.modules if m.split(".")[0] in ("pytest", "_pytest", "httpx", "numpy")
            )
            row["main"] = getattr(sys.modules.get("__main__"), "__file__", None)
        elif kind == "cancel-aware":
            try:
                await trio.sleep(float(args[0]))
            except trio.Cancelled:
                row["error"] = {"class": "cancelled", "message": "job's own cancelled row"}
                return [row]
        return [row]


def _arenas_after_threads(n: int) -> int | None:
    """Allocate small blocks from ``n`` threads at once (each thread that
    finds an arena busy gets its own, up to the arena maximum); count arenas."""
    barrier = threading.Barrier(n)
    keep: list[list[bytearray]] = []

    def work() -> None:
        barrier.wait()
        mine = [bytearray(64) for _ in range(20000)]
        keep.append(mine)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    count = arena_count()
    keep.clear()
    return count


def make(**kwargs: Any) -> ToyJob:
    return ToyJob(**kwargs)


FACTORY = f"{__name__}:make"
