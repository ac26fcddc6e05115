"""A Trio loop in a background thread, for fixtures usable from any test style.

Sync tests, ``trio.run`` tests and asyncio tests can all talk to servers the
loop runs (they are plain HTTP on loopback), and the loop is torn down
(cancelled, joined) at fixture teardown.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class BackgroundTrio:
    """Run a Trio loop in a daemon thread until :meth:`close`.

    ``start(fn, *args)`` runs ``await nursery.start(fn, *args)`` in the
    loop's nursery and returns the value passed to ``task_status.started``;
    ``run(fn, *args)`` awaits ``fn(*args)`` there and returns its result.
    """

    def __init__(self) -> None:
        ready: queue.Queue[None] = queue.Queue()
        self._thread = threading.Thread(
            target=trio.run, args=(self._main, ready), name="lowwater-test-trio", daemon=True
        )
        self._thread.start()
        ready.get()

    async def _main(self, ready: queue.Queue[None]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            ready.put(None)
            await self._done.wait()
            nursery.cancel_scope.cancel()

    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.from_thread.run(lambda: self._nursery.start(fn, *args), trio_token=self._token)

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel everything the loop runs and join the thread (idempotent)."""
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._done.set, trio_token=self._token)
            self._thread.join(timeout_s)
