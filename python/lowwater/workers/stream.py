"""Task streams: ids handed to a pool lazily, over time, from another task.

:meth:`lowwater.workers.WorkerPool.run` takes a plain iterable (an eval's
taskset, pulled one id per free slot) or an async iterable; a
:class:`TaskStream` is the async iterable a long-lived pool is fed from
(the trainer API submits each step's groups to a pool that outlives the
step).  An item may be a :class:`TaskAttempt` to run a task at a given
attempt (a backend re-queueing the tasks of a node pool that died).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs
import trio


@attrs.frozen
class TaskAttempt:
    """A task id to run at ``attempt`` (``>= 1``) instead of 1.

    The pool counts worker deaths from there: a task submitted at attempt
    2 gets its synthesized ``infra`` row after ``max_task_attempts - 1``
    more deaths.
    """

    task_id: Any
    attempt: int = 1


class TaskStream:
    """An async iterable of task ids that stays open until :meth:`close`.

    ``submit`` never blocks (ids are kept, in order, until a pool pulls
    them; the pool pulls one id per free slot, so the stream holds what is
    waiting, never what is running).  Iterate it once.
    """

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[Any](math.inf)
        self.submitted = 0

    def submit(self, task_ids: Iterable[Any]) -> None:
        """Queue ``task_ids`` (ids or :class:`TaskAttempt`).

        Raises:
            trio.ClosedResourceError: the stream was closed.
        """
        for task_id in task_ids:
            self._send.send_nowait(task_id)
            self.submitted += 1

    def close(self) -> None:
        """No more ids: the pool finishes what it has and returns (idempotent)."""
        self._send.close()

    @property
    def waiting(self) -> int:
        """Ids submitted and not yet pulled."""
        return self._recv.statistics().current_buffer_used

    def __aiter__(self) -> TaskStream:
        return self

    async def __anext__(self) -> Any:
        # A channel receive, not an async generator: a pool cancelled while
        # waiting for the next id loses nothing and leaves no generator to finalize.
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


__all__ = ["TaskAttempt", "TaskStream"]
