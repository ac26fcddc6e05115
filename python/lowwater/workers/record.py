"""The parent's record of one worker process: its state, process handles and
latest numbers.  Holds task ids and attempt counts, never payloads or rows."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from lowwater.workers.protocol import FramedStream


class WorkerState(enum.Enum):
    """Where a worker is in its life.

    ``STARTING -> READY -> RETIRING -> EXITING``; any state ``-> DEAD``
    (its stream ended) ``-> REAPED`` (process waited for, slot freed).  A
    worker told to stop while starting or ready goes straight to ``EXITING``.
    """

    STARTING = "starting"
    READY = "ready"
    RETIRING = "retiring"
    EXITING = "exiting"
    DEAD = "dead"
    REAPED = "reaped"

    @property
    def serving(self) -> bool:
        """Counts toward the pool's ``workers`` (a retiree's replacement is due)."""
        return self in (WorkerState.STARTING, WorkerState.READY)

    @property
    def running(self) -> bool:
        """Not yet told to exit: a stop must send it ``exit``."""
        return self in (WorkerState.STARTING, WorkerState.READY, WorkerState.RETIRING)

    @property
    def gone(self) -> bool:
        """Its stream ended: its RSS no longer counts, the watchdog skips it."""
        return self in (WorkerState.DEAD, WorkerState.REAPED)


@attrs.define(eq=False)
class WorkerRecord:
    """One worker, as the pool sees it.

    Attributes:
        wid: index in this pool (never reused).
        max_tasks: jittered task count after which it retires (``None``: never).
        max_rss: jittered RSS limit in bytes (``None``: none).
        pending: in-flight tasks, ``seq -> (task_id, attempt)``.
        rss, ready_rss, peak_rss: bytes; latest, after setup, highest seen.
        started_at, ready_at, last_seen: ``time.monotonic()`` seconds.
        hb: the latest heartbeat message.
        settled: idle, collected and trimmed per its latest heartbeat.
        replacement: the worker started to take over from this retiree.
        death: why it ended unasked (``"crash"``, ``"heartbeat"``,
            ``"start-timeout"``...), ``None`` if it was told to exit.
        fatal: the error it reported before dying, if any.
    """

    wid: int
    max_tasks: int | None
    max_rss: float | None
    state: WorkerState = WorkerState.STARTING
    process: Any = None
    pid: int | None = None
    stream: FramedStream | None = None
    lifeline: Any = None
    outbox: Any = None
    pending: dict[int, tuple[Any, int]] = attrs.field(factory=dict)
    dispatched: int = 0
    completed: int = 0
    rss: int = 0
    ready_rss: int = 0
    peak_rss: int = 0
    started_at: float = 0.0
    ready_at: float | None = None
    last_seen: float = 0.0
    hb: dict[str, Any] = attrs.field(factory=dict)
    settled: bool = False
    allocator: dict[str, Any] = attrs.field(factory=dict)
    replacement: WorkerRecord | None = None
    retire_reason: str | None = None
    death: str | None = None
    exit_sent: bool = False
    exitcode: int | None = None
    fatal: str | None = None
