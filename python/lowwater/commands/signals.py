"""Ctrl-C and SIGTERM end a command by cancellation, not by KeyboardInterrupt.

Left to Trio's default, Ctrl-C raises KeyboardInterrupt wherever the loop
happens to be, inside hypercorn's shutdown or a results file's write
included; under load in CI, ``lowwater proxy`` once exited 1 instead of 130
that way.  Cancelling instead sends every in-flight rollout down its
cancellation path (closed, swept, written), so results already written stay
whole and a run stays resumable.  Used by ``lowwater eval``, ``lowwater
proxy`` and ``lowwater serve-model``.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


async def until_signal(work: Callable[[], Awaitable[T]]) -> tuple[T | None, int]:
    """Run ``work()`` until it returns or SIGINT / SIGTERM arrives.

    Returns:
        ``(result, 0)`` when ``work`` finished (also if a signal came as it
        did: the work is whole), or ``(None, signum)`` when the signal
        cancelled it.

    The signal handlers are installed before ``work`` starts and restored
    once the first signal is taken, so a second Ctrl-C interrupts the
    cancellation's own cleanup.  Exceptions from ``work`` propagate, wrapped
    in an exception group by the nursery.
    """
    result: list[Any] = []
    caught: list[int] = []

    async def run(nursery: trio.Nursery) -> None:
        result.append(await work())
        nursery.cancel_scope.cancel()

    async def watch(nursery: trio.Nursery, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                caught.append(signum)
                nursery.cancel_scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        await nursery.start(watch, nursery)
        nursery.start_soon(run, nursery)
    if result:
        return result[0], 0
    return None, caught[0]
