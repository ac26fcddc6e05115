"""RuntimePool: persistent runtimes, reset between uses, torn down at run end.

Runtimes are keyed by their resolved :class:`RuntimeConfig` (frozen and
hashable), so two configs that differ only in spelling share runtimes and
two that differ in substance never do.  The life of a pooled runtime:

``acquire`` -> (idle one that is still ``healthy()``, else a new one:
factory + ``start``) -> the user runs programs -> ``release`` -> ``reset``
-> ``healthy()`` -> idle again, or stopped and counted as ``replaced`` when
reset failed or the health check said no.  ``aclose`` stops every runtime,
idle or in use, and the stats end at ``idle == in_use == 0``.

With ``grow="demand"`` the pool is sized to demand rather than to
``max_size``: the first acquire of a config starts a runtime; a later one
that finds none idle waits for a release (in arrival order) and starts
another only when the predicted wait (waiters x recent hold time /
runtimes) exceeds ``grow_floor_s``, or it has waited longer than twice the
hold time and at least ``grow_floor_s`` (before any hold time is known:
``first_grow_after_s``), one start at a time per config; runtimes idle for
``idle_retire_s`` are stopped, all but one.  On GSM8K a pool of four held
four warm math-verify workers of about 57 MiB each, although scoring all
1319 answers costs about 1.1 CPU seconds (benches/eval_gsm8k.py).

Everything the pool does on the way out (reset, stop, bookkeeping) runs
shielded under a deadline, so a cancelled rollout still returns or stops
its runtime: the pool never loses track of one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import trio

from lowwater.runtime.base import PoolClosed, Runtime, RuntimeConfig, RuntimeStartError

log = logging.getLogger("lowwater.runtime.pool")

Factory = Callable[[RuntimeConfig], Runtime]


def _default_factories() -> dict[str, Factory]:
    from lowwater.runtime.subprocess import SubprocessRuntime

    return {"subprocess": SubprocessRuntime}


class _Acquire:
    """What :meth:`RuntimePool.acquire` returns: await it for a runtime (and
    call ``release`` yourself), or use it as ``async with`` (released on exit,
    on every exit path)."""

    def __init__(self, pool: RuntimePool, config: RuntimeConfig) -> None:
        self._pool = pool
        self._config = config
        self._runtime: Runtime | None = None

    def __await__(self) -> Any:
        return self._pool._acquire(self._config).__await__()

    async def __aenter__(self) -> Runtime:
        self._runtime = await self._pool._acquire(self._config)
        return self._runtime

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            await self._pool.release(runtime)


class RuntimePool:
    """Persistent runtimes keyed by resolved config.

    Args:
        factories: runtime name -> factory (``Plugins.runtimes``), or one
            factory for every config; default: the built-in ``subprocess``.
        max_size: most runtimes in use at once (``None``: unbounded);
            ``acquire`` waits for a release beyond it.  Also the default
            for ``max_idle``.
        max_idle: most idle runtimes kept across all keys; a release beyond
            it stops the runtime instead.
        cleanup_timeout_s: bound on one ``reset`` or ``stop`` (seconds).
        grow: ``"eager"`` (default): start a runtime whenever none is idle,
            up to ``max_size``; ``"demand"``: start one only while acquires
            wait (see the module doc).
        first_grow_after_s: with ``grow="demand"``, how long an acquire waits
            for a release before the first hold time is known, and at most
            (seconds; a runtime's first use includes its warm workers' imports).
        grow_floor_s: with ``grow="demand"``, the shortest wait that starts
            another runtime (seconds): a burst of 32 GSM8K scores of 12 ms
            each (plus a reset per use) takes about half a second on one
            warm worker; growing at twice the hold time (24 ms), then at
            0.5 s, still started all four.  Waits this long mean the
            runtimes are saturated, not that a burst is draining.
        idle_retire_s: with ``grow="demand"``, runtimes idle this long are
            stopped, all but the most recently used one (seconds).
    """

    def __init__(
        self,
        factories: Mapping[str, Factory] | Factory | None = None,
        *,
        max_size: int | None = None,
        max_idle: int | None = None,
        cleanup_timeout_s: float = 30.0,
        grow: str = "eager",
        first_grow_after_s: float = 5.0,
        grow_floor_s: float = 2.0,
        idle_retire_s: float = 30.0,
    ) -> None:
        if max_size is not None and max_size < 1:
            raise ValueError("max_size must be >= 1")
        if grow not in ("eager", "demand"):
            raise ValueError(f"grow must be 'eager' or 'demand', not {grow!r}")
        self.grow = grow
        self.first_grow_after_s = first_grow_after_s
        self.grow_floor_s = grow_floor_s
        self.idle_retire_s = idle_retire_s
        # Demand growth: per config, runtimes being started, waiters parked
        # until a release, and the recent hold time (seconds, EMA).
        self._starting: dict[RuntimeConfig, int] = {}
        self._waiting: dict[RuntimeConfig, int] = {}
        self._releasing: dict[RuntimeConfig, int] = {}
        self._released: dict[RuntimeConfig, trio.lowlevel.ParkingLot] = {}
        self._hold_s: dict[RuntimeConfig, float] = {}
        self._acquired_at: dict[int, float] = {}
        self._used: set[int] = set()
        self._idle_since: dict[int, float] = {}
        self._factories = _default_factories() if factories is None else factories
        self.max_size = max_size
        self.max_idle = max_idle if max_idle is not None else max_size
        self.cleanup_timeout_s = cleanup_timeout_s
        # With demand growth the bound is kept by refusing to start one past
        # max_size, and acquires queue for releases themselves: a limiter in
        # front of them hid the queue's length from the growth decision.
        self._limiter = trio.CapacityLimiter(max_size) if max_size is not None and grow == "eager" else None
        self._idle: dict[RuntimeConfig, list[Runtime]] = {}
        self._in_use: dict[int, tuple[Runtime, RuntimeConfig, object]] = {}
        # Runtimes aclose() stopped while held: their holders' release()
        # only gives back the limiter token.
        self._stopped_held: dict[int, tuple[Runtime, RuntimeConfig, object]] = {}
        self._closed = False
        self.created = 0
        self.replaced = 0
        self.stopped = 0
        self.start_failures = 0

    # -- stats ---------------------------------------------------------------

    @property
    def idle(self) -> int:
        """Runtimes waiting in the pool."""
        return sum(len(v) for v in self._idle.values())

    @property
    def in_use(self) -> int:
        """Runtimes acquired and not yet released."""
        return len(self._in_use)

    def stats(self) -> dict[str, int]:
        """``idle``, ``in_use``, ``created``, ``replaced`` (stopped because
        reset or the health check failed), ``stopped`` (all stops) and
        ``start_failures``."""
        return {
            "idle": self.idle,
            "in_use": self.in_use,
            "created": self.created,
            "replaced": self.replaced,
            "stopped": self.stopped,
            "start_failures": self.start_failures,
        }

    # -- acquire / release ---------------------------------------------------

    def acquire(self, config: RuntimeConfig) -> _Acquire:
        """A runtime for ``config``: ``rt = await pool.acquire(cfg)`` (then
        ``await pool.release(rt)``), or ``async with pool.acquire(cfg) as rt``.

        Raises (when awaited or entered):
            RuntimeStartError: no factory for ``config.kind``, the factory
                or ``start`` failed (the cause is chained), or the config
                does not resolve.
            PoolClosed: after :meth:`aclose`.
        """
        return _Acquire(self, config)

    async def _acquire(self, config: RuntimeConfig) -> Runtime:
        if self._closed:
            raise PoolClosed("runtime pool is closed")
        key = config.resolved()
        token = object()
        if self._limiter is not None:
            await self._limiter.acquire_on_behalf_of(token)
        try:
            if self._closed:
                raise PoolClosed("runtime pool is closed")
            if self.grow == "demand":
                runtime = await self._wait_or_create(key)
            else:
                runtime = await self._take_idle(key) or await self._create(key)
            if self._closed:  # closed while we waited or started
                await self._stop(runtime)
                raise PoolClosed("runtime pool is closed")
        except BaseException:
            if self._limiter is not None:
                self._limiter.release_on_behalf_of(token)
            raise
        self._in_use[id(runtime)] = (runtime, key, token)
        self._acquired_at[id(runtime)] = trio.current_time()
        return runtime

    # -- demand growth -----------------------------------------------------------

    def _room(self) -> bool:
        """Whether another runtime may start: ``max_size`` bounds those in use
        (or starting, or being released) across configs, as the limiter does
        with ``grow="eager"``; idle ones are bounded by ``max_idle``."""
        if self.max_size is None:
            return True
        busy = len(self._in_use) + sum(self._starting.values()) + sum(self._releasing.values())
        return busy < self.max_size

    def _live(self, key: RuntimeConfig) -> int:
        """Runtimes of ``key`` that exist or are starting."""
        in_use = sum(1 for _, k, _ in self._in_use.values() if k == key)
        # A runtime being reset after its release, or health-checked as it is
        # taken, is neither in use nor idle: counted, or an acquire arriving
        # then would start a second one (it did, on GSM8K).
        return in_use + len(self._idle.get(key, ())) + self._starting.get(key, 0) + self._releasing.get(key, 0)

    def _grow_after_s(self, key: RuntimeConfig) -> float:
        hold = self._hold_s.get(key)
        if hold is None:
            return self.first_grow_after_s
        return min(self.first_grow_after_s, max(self.grow_floor_s, 2.0 * hold))

    async def _wait_or_create(self, key: RuntimeConfig) -> Runtime:
        """A released runtime of ``key``, or a new one once waiting is no longer
        cheaper than starting one (at most one start per key at a time).

        Waiters are served in arrival order: a release wakes the oldest, and
        an acquire arriving while others wait queues behind them.  Letting
        new arrivals take what a release freed starved the waiters of the
        first seconds until their patience ran out and they started three
        more runtimes (measured on GSM8K).
        """
        lot = self._released.setdefault(key, trio.lowlevel.ParkingLot())
        deadline = trio.current_time() + self._grow_after_s(key)
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            if self._waiting[key] > 1:
                with trio.move_on_at(deadline):
                    await lot.park()
            while True:
                if self._closed:
                    raise PoolClosed("runtime pool is closed")
                runtime = await self._take_idle(key)
                if runtime is not None:
                    return runtime
                overdue = trio.current_time() >= deadline
                grow = self._live(key) == 0 or (overdue and not self._starting.get(key)) or self._should_grow(key)
                if grow and self._room():
                    return await self._create_counted(key)
                if overdue:  # a start is under way: give it one more interval
                    deadline = trio.current_time() + self._grow_after_s(key)
                with trio.move_on_at(deadline):
                    await lot.park()
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
            if self._waiting.get(key) and (self._idle.get(key) or self._should_grow(key)):
                # A runtime left idle, or a queue that will not drain soon:
                # the next waiter takes it, or starts one.
                lot.unpark(count=1)

    async def _create_counted(self, key: RuntimeConfig) -> Runtime:
        self._starting[key] = self._starting.get(key, 0) + 1
        try:
            return await self._create(key)
        finally:
            self._starting[key] -= 1
            if not self._starting[key]:
                del self._starting[key]
            lot = self._released.get(key)
            if lot is not None and self._should_grow(key):
                lot.unpark(count=1)  # the queue still predicts a long wait: the next waiter starts one

    def _note_release(self, runtime: Runtime, key: RuntimeConfig) -> None:
        started = self._acquired_at.pop(id(runtime), None)
        first_use = id(runtime) not in self._used
        self._used.add(id(runtime))
        if started is not None and not first_use:
            # A runtime's first use pays its warm workers' imports: not a hold
            # time to plan by (counting it predicted a 31 s queue for 8 ms scores).
            held = trio.current_time() - started
            previous = self._hold_s.get(key)
            self._hold_s[key] = held if previous is None else 0.8 * previous + 0.2 * held

    def _should_grow(self, key: RuntimeConfig) -> bool:
        """Whether the waiters' predicted wait (waiters x hold time / runtimes)
        exceeds ``grow_floor_s`` and no start of ``key`` is under way."""
        hold = self._hold_s.get(key)
        if hold is None or self._starting.get(key) or not self._room():
            return False
        return self._waiting.get(key, 0) * hold / max(1, self._live(key)) > self.grow_floor_s

    async def _retire_idle(self) -> None:
        """Stop runtimes idle past ``idle_retire_s``, keeping the freshest of each config."""
        now = trio.current_time()
        for stack in list(self._idle.values()):
            old = [rt for rt in stack[:-1] if now - self._idle_since.get(id(rt), now) >= self.idle_retire_s]
            for runtime in old:
                stack.remove(runtime)
                self._idle_since.pop(id(runtime), None)
                await self._stop(runtime)

    async def _take_idle(self, key: RuntimeConfig) -> Runtime | None:
        stack = self._idle.get(key)
        while stack:
            runtime = stack.pop()  # most recently used: its workers are warmest
            self._idle_since.pop(id(runtime), None)
            if not stack:
                del self._idle[key]
            self._releasing[key] = self._releasing.get(key, 0) + 1  # in neither dict while checked
            try:
                healthy = await self._healthy(runtime)
            finally:
                self._releasing[key] -= 1
                if not self._releasing[key]:
                    del self._releasing[key]
            if healthy:
                return runtime
            self.replaced += 1
            await self._stop(runtime)
            stack = self._idle.get(key)
        return None

    async def _create(self, key: RuntimeConfig) -> Runtime:
        factory = self._factory(key)
        try:
            runtime = factory(key)
        except Exception as exc:
            self.start_failures += 1
            raise RuntimeStartError(f"runtime {key.kind!r}: factory failed: {exc}") from exc
        try:
            await runtime.start()
        except BaseException as exc:
            await self._stop(runtime, count=False)
            if isinstance(exc, Exception):
                self.start_failures += 1
                if not isinstance(exc, RuntimeStartError):
                    raise RuntimeStartError(f"runtime {key.kind!r} failed to start: {exc}") from exc
            raise
        self.created += 1
        return runtime

    def _factory(self, key: RuntimeConfig) -> Factory:
        if not isinstance(self._factories, Mapping):
            return self._factories
        try:
            return self._factories[key.kind]
        except KeyError:
            self.start_failures += 1
            known = ", ".join(sorted(self._factories)) or "none"
            raise RuntimeStartError(f"no runtime named {key.kind!r} (registered: {known})") from None

    async def release(self, runtime: Runtime) -> None:
        """Give ``runtime`` back: reset it and keep it idle if still healthy,
        else stop it.  Shielded (completes under cancellation); never raises
        for a failing reset or stop (logged and counted instead).

        Raises:
            ValueError: ``runtime`` was not acquired from this pool (or was
                released already).
        """
        entry = self._in_use.pop(id(runtime), None)
        if entry is None:
            entry = self._stopped_held.pop(id(runtime), None)
            if entry is not None and entry[0] is runtime:
                if self._limiter is not None:
                    self._limiter.release_on_behalf_of(entry[2])
                return
        if entry is None or entry[0] is not runtime:
            raise ValueError("runtime was not acquired from this pool, or was released already")
        _, key, token = entry
        self._note_release(runtime, key)
        self._releasing[key] = self._releasing.get(key, 0) + 1
        try:
            with trio.CancelScope(shield=True):
                good = not self._closed and await self._reset(runtime) and await self._healthy(runtime)
                if not good and not self._closed:
                    self.replaced += 1
                # Checked after the awaits: aclose() may have run meanwhile.
                if good and not self._closed and (self.max_idle is None or self.idle < self.max_idle):
                    self._idle.setdefault(key, []).append(runtime)
                    self._idle_since[id(runtime)] = trio.current_time()
                else:
                    await self._stop(runtime)
                if self.grow == "demand" and not self._closed:
                    await self._retire_idle()
        finally:
            self._releasing[key] -= 1
            if not self._releasing[key]:
                del self._releasing[key]
            if self._limiter is not None:
                self._limiter.release_on_behalf_of(token)
            lot = self._released.get(key)
            if lot is not None:
                lot.unpark(count=1)  # the oldest waiter takes it, or starts one if it was stopped

    # -- teardown ------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop every runtime, idle and in use, concurrently; later
        ``acquire`` calls raise :class:`PoolClosed`, later ``release`` calls
        stop nothing more.  Idempotent; shielded."""
        self._closed = True
        for lot in self._released.values():
            lot.unpark_all()  # acquires waiting for a release see the pool closed
        idle = [rt for stack in self._idle.values() for rt in stack]
        self._idle.clear()
        # In-use runtimes are stopped too (the run is over); their holders'
        # later release() finds them stopped and only balances the limiter.
        busy = [rt for rt, _, _ in self._in_use.values()]
        self._stopped_held.update(self._in_use)
        self._in_use.clear()
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for runtime in idle + busy:
                    nursery.start_soon(self._stop, runtime)

    async def __aenter__(self) -> RuntimePool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- helpers -------------------------------------------------------------

    async def _reset(self, runtime: Runtime) -> bool:
        with trio.move_on_after(self.cleanup_timeout_s) as scope:
            try:
                await runtime.reset()
            except Exception:
                log.warning("runtime reset failed; replacing it", exc_info=True)
                return False
        if scope.cancelled_caught:
            log.warning("runtime reset took over %s s; replacing it", self.cleanup_timeout_s)
            return False
        return True

    async def _healthy(self, runtime: Runtime) -> bool:
        with trio.move_on_after(self.cleanup_timeout_s):
            try:
                return bool(await runtime.healthy())
            except Exception:
                log.warning("runtime health check raised; replacing it", exc_info=True)
        return False

    async def _stop(self, runtime: Runtime, *, count: bool = True) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(self.cleanup_timeout_s):
            try:
                await runtime.stop()
            except Exception:
                log.warning("runtime stop failed", exc_info=True)
        if count:
            self.stopped += 1
