"""The pool's settings: one frozen, validated :class:`PoolConfig`.

``WorkerPool(spec, workers=4, ...)`` builds one from its keyword arguments;
``WorkerPool(spec, config)`` takes one as is.  Every range check happens
here, when the config is built, and raises :class:`PoolConfigError` (a
``ValueError``), so a bad value fails before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from lowwater import _validate as v
from lowwater.workers.allocator import OFF
from lowwater.workers.contract import PoolConfigError

_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _at_least(low: int, *, or_none: bool = False) -> _Validator:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and or_none:
            return
        if value is None or value < low:
            raise PoolConfigError(f"{attribute.name} must be >= {low}{' or None' if or_none else ''}, not {value}")

    return check


def _positive(*, or_none: bool = False) -> _Validator:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and or_none:
            return
        if value is None or value <= 0:
            raise PoolConfigError(f"{attribute.name} must be > 0{' or None' if or_none else ''}, not {value}")

    return check


def _non_negative(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value < 0:
        raise PoolConfigError(f"{attribute.name} must be >= 0, not {value}")


def _fraction(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not 0 < value <= 1:
        raise PoolConfigError(f"{attribute.name} must be in (0, 1], not {value}")


def _jitter(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not 0 <= value < 1:
        raise PoolConfigError(f"jitter must be in [0, 1), not {value}")


def _allocator_value(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, str) and value != OFF:
        raise PoolConfigError(f"{attribute.name} must be an integer, None or {OFF!r}, not {value!r}")


def _start_method(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ("forkserver", "spawn"):
        raise PoolConfigError(f"start_method must be 'forkserver' or 'spawn', not {value!r}")


@attrs.frozen(kw_only=True)
class PoolConfig:
    """How a :class:`~lowwater.workers.WorkerPool` runs its workers.

    Attributes:
        workers: worker processes serving at once (>= 1); one more may run
            while a retiring worker hands over.
        concurrency_per_worker: tasks in flight per worker (>= 1).
        max_tasks_per_worker: a worker retires after this many tasks
            (jittered down per worker); ``None``: never by count.
        max_rss_mb: a worker retires when its current RSS (MiB) exceeds this
            (jittered down per worker); ``None``: never by RSS.
        jitter: each worker's thresholds are scaled by a factor drawn
            uniformly from ``[1 - jitter, 1]`` (``0 <= jitter < 1``), so
            workers started together do not retire together.
        high_water_mb, low_water_mb: per-worker admission marks (MiB of
            current RSS); ``None``: no per-worker admission.  ``low_water_mb``
            defaults to 80 % of ``high_water_mb`` and needs it.
        pool_high_water_fraction, pool_low_water_fraction: the pool's marks,
            as fractions of the memory limit (``0 < low <= high <= 1``), for
            the parent's RSS plus every worker's.
        memory_limit_mb: the limit the pool's marks refer to (MiB); ``None``:
            the cgroup limit or the machine's memory
            (:func:`~lowwater.workers.memory_limit_bytes`).
        heartbeat_s: cadence of worker heartbeats (seconds).
        heartbeat_timeout_s: a ready worker silent this long is killed and
            replaced (seconds, > ``heartbeat_s``; generous: a blocked loop is
            a bug, not a blip).
        start_timeout_s: a worker must be ready (job imported and set up)
            within this many seconds of its start.
        max_task_attempts: runs of a task whose worker died, before the pool
            gives up and synthesizes an ``infra`` error row.
        max_start_failures: consecutive worker start failures before
            :class:`~lowwater.workers.WorkerStartError` is raised.
        exit_timeout_s: time a worker told to exit gets for ``teardown()``
            before it is killed; also the worker's own teardown deadline
            (seconds).
        cancel_grace_s: on cancellation, time workers get to answer for
            their cancelled tasks before they are stopped (seconds).
        malloc_arena_max, malloc_trim_threshold: allocator settings for
            workers (see :mod:`lowwater.workers.allocator`); ``None``: the
            environment's value, else 2 arenas and 128 KiB; ``"off"``: leave
            that setting to glibc.
        allocator_hygiene: ``False`` leaves the allocator alone.
        trim_at_quiescence: trim the allocator (``malloc_trim``, off the
            loop) whenever a worker's in-flight count drops to zero.
        trim_interval_s: minimum seconds between a worker's ``malloc_trim`` calls.
        gc_at_quiescence: run ``gc.collect()`` when a worker goes idle,
            before trimming (reference cycles hold memory until collected).
        lag_interval_s: period of the worker's loop-lag probe (seconds).
        orphan_grace_s: seconds a worker whose owner died waits before it
            kills itself and its descendants.
        preload: extra modules for the forkserver to preload (shared by all
            workers: put the job's heavy, fork-safe imports here).
        start_method: ``"forkserver"`` (the default, docs/workers.md) or
            ``"spawn"`` (a fresh interpreter per worker that also imports the
            parent's ``__main__``: for comparison only).
        seed: seed of the jitter draws (``None``: random).

    Raises:
        PoolConfigError: a value out of range (the message names it).
    """

    workers: int = attrs.field(validator=_at_least(1))
    concurrency_per_worker: int = attrs.field(default=8, validator=_at_least(1))
    max_tasks_per_worker: int | None = attrs.field(default=500, validator=_at_least(1, or_none=True))
    max_rss_mb: float | None = attrs.field(default=None, validator=_positive(or_none=True))
    jitter: float = attrs.field(default=0.1, validator=_jitter)
    high_water_mb: float | None = attrs.field(default=None, validator=_positive(or_none=True))
    low_water_mb: float | None = attrs.field(default=None, validator=_positive(or_none=True))
    pool_high_water_fraction: float = attrs.field(default=0.85, validator=_fraction)
    pool_low_water_fraction: float = attrs.field(default=0.75, validator=_fraction)
    memory_limit_mb: float | None = attrs.field(default=None, validator=_positive(or_none=True))
    heartbeat_s: float = attrs.field(default=1.0, validator=_positive())
    heartbeat_timeout_s: float = attrs.field(default=60.0, validator=_positive())
    start_timeout_s: float = attrs.field(default=120.0, validator=_positive())
    max_task_attempts: int = attrs.field(default=3, validator=_at_least(1))
    max_start_failures: int = attrs.field(default=3, validator=_at_least(1))
    exit_timeout_s: float = attrs.field(default=30.0, validator=_positive())
    cancel_grace_s: float = attrs.field(default=10.0, validator=_non_negative)
    malloc_arena_max: int | str | None = attrs.field(default=None, validator=_allocator_value)
    malloc_trim_threshold: int | str | None = attrs.field(default=None, validator=_allocator_value)
    allocator_hygiene: bool = True
    trim_at_quiescence: bool = True
    trim_interval_s: float = attrs.field(default=1.0, validator=_non_negative)
    gc_at_quiescence: bool = True
    lag_interval_s: float = attrs.field(default=0.05, validator=_positive())
    orphan_grace_s: float = attrs.field(default=5.0, validator=_non_negative)
    preload: tuple[str, ...] = attrs.field(default=(), converter=v.str_tuple)
    start_method: str = attrs.field(default="forkserver", validator=_start_method)
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise PoolConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_s ({self.heartbeat_s})"
            )
        if self.pool_low_water_fraction > self.pool_high_water_fraction:
            raise PoolConfigError(
                f"need pool_low_water_fraction <= pool_high_water_fraction, "
                f"got {self.pool_low_water_fraction} and {self.pool_high_water_fraction}"
            )
        if self.low_water_mb is not None:
            if self.high_water_mb is None:
                raise PoolConfigError("low_water_mb needs high_water_mb")
            if self.low_water_mb > self.high_water_mb:
                raise PoolConfigError(
                    f"need low_water_mb <= high_water_mb, got {self.low_water_mb} and {self.high_water_mb}"
                )
