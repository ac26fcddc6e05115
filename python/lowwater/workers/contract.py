"""The pool's contract with its users: the job a worker runs (:class:`JobSpec`,
:class:`WorkerJob`), what ``on_rows`` and ``run`` return (:class:`TaskInfo`,
:class:`PoolReport`) and the pool's errors.  Re-exported by
:mod:`lowwater.workers`; see ``docs/workers.md``.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio


@attrs.frozen
class JobSpec:
    """A picklable, JSON-able description of a job, built in each worker.

    Attributes:
        factory: ``"package.module:callable"``, imported in the worker;
            ``callable(**kwargs)`` returns a :class:`WorkerJob`.  It must be
            importable by module name (not defined in ``__main__``: workers
            do not import the parent's main module).
        kwargs: JSON-able keyword arguments for the factory.

    Raises:
        ValueError: ``factory`` is not of the form ``module:callable``.
    """

    factory: str
    kwargs: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"factory must be 'module:callable', not {self.factory!r}")


class WorkerJob:
    """Base class of the job a worker runs; subclass and name a factory in a :class:`JobSpec`.

    All methods run in the worker process, on its Trio loop.
    ``setup()`` and ``teardown()`` run in the same task around the serving
    loop, but ``teardown()`` runs inside its own (shielded, deadline-bound)
    cancel scope: a nursery or cancel scope that ``setup`` entered (say
    through an ``AsyncExitStack``) must not be exited by ``teardown``, or
    Trio's scope stack is corrupted.  Hold such contexts open in a service
    task instead: ``self.nursery`` is set before ``setup()``, a nursery for
    background services (an interception server, a model client),
    cancelled after ``teardown()``; :class:`lowwater.eval.job.EvalJob`
    shows the pattern.
    """

    nursery: trio.Nursery

    async def setup(self) -> None:
        """Once per worker process, before the first task."""

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        """Run one task and return its result rows (JSON-serialisable dicts).

        ``attempt`` starts at 1 and grows when a task is re-run after its
        worker died.  An exception becomes one error row (class ``infra``);
        on cancellation (pool shutdown) the worker sends one row with error
        class ``cancelled``, unless ``run`` catches the cancellation and
        returns its own rows.
        """
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Extra heartbeat stats (table stats...): cheap, non-blocking, JSON-able."""
        return {}

    def leftovers(self) -> dict[str, int]:
        """Per-task state still alive after ``teardown()``: name -> count,
        only the non-zero ones (empty when nothing leaked).  Sent to the
        parent as the worker exits and summed into
        :attr:`PoolReport.leftovers`, so a leak in a worker is reported where
        the run's summary is, not only in the worker's log."""
        return {}

    async def tick(self, stats: dict[str, Any]) -> None:
        """Called on the heartbeat cadence in its own task (fire ``worker_tick`` here).

        ``stats`` has ``rss_bytes``, ``in_flight`` and ``finished``.
        """

    async def teardown(self) -> None:
        """Once, when the worker stops (under ``teardown_timeout_s``)."""


@attrs.frozen
class TaskInfo:
    """What ``on_rows`` is told about a finished task.

    Attributes:
        task_id: the id as it came from the iterable.
        attempt: 1 for a first run; higher after re-runs.
        retried: ``attempt > 1``: an earlier worker died running it.
        pid: the worker's pid (``None`` when the row was synthesized before
            any worker ran it).
        worker: the worker's index in this pool (``-1`` if none).
        status: ``"ok"``, ``"error"`` (the job raised), ``"cancelled"``
            (shutdown), or ``"failed"`` (the pool synthesized an infra row
            after ``max_task_attempts`` worker deaths).
    """

    task_id: Any
    attempt: int
    retried: bool
    pid: int | None
    worker: int
    status: str


@attrs.define
class PoolReport:
    """What :meth:`WorkerPool.run` returns (counts are per run; ``_s``
    seconds, ``_mb`` MiB of current RSS)."""

    tasks: int = 0
    rows: int = 0
    admission_wait_s: float = 0.0
    admission_holds: int = 0
    admission_forced: int = 0
    recycled_by_count: int = 0
    recycled_by_rss: int = 0
    replaced_after_crash: int = 0
    replaced_after_heartbeat_timeout: int = 0
    retried_tasks: int = 0
    failed_tasks: int = 0
    start_failures: int = 0
    workers_started: int = 0
    max_workers_alive: int = 0
    worker_rss_peak_mb: float = 0.0
    pool_rss_peak_mb: float = 0.0
    memory_limit_mb: float = 0.0
    memory_limit_source: str = ""
    cancelled: bool = False
    wall_s: float = 0.0
    leftovers: dict[str, int] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class WorkerStartError(RuntimeError):
    """Workers failed to start (import or ``setup()`` error, or no ``ready``
    within ``start_timeout_s``) ``max_start_failures`` times in a row."""


class PoolConfigError(ValueError):
    """A pool setting out of range (raised by :class:`~lowwater.workers.config.PoolConfig`),
    or a threshold a fresh worker already exceeds (raised by ``run``: it would
    recycle or be held forever)."""
