"""Rollout and group lifecycle on Trio.

A rollout runs ``open`` (register an interception slot; a runtime is taken
on first use) -> harness turns -> ``score`` -> ``close`` (unregister, release
the runtime, hand the result to the caller, fire ``rollout_end``, evict the
trajectory).  ``abort`` is ``close`` without scoring: what cancellation and
errors take.

The :class:`Engine` is the one owner of every per-rollout structure it opens
and the one place each is released (docs/memory-contract.md): the slot (with
its intercepts) and the runtime at the end of each attempt, the trajectory at
rollout close (ungrouped) or group cleanup (grouped, so the group reward
still reads every member).  Cleanup policies never evict them.

Deadlines: the whole-rollout deadline starts when the rollout starts work
(admission and queueing do not count against it), each phase has its own,
and cleanup runs shielded under a deadline of its own, so a cancelled or
timed-out rollout still frees everything it held (docs/design.md#incidents: the
env-worker incident, where trajectories outlived their rollouts).

Errors are data: a failed rollout records a :class:`RolloutError` with a
class from :data:`ERROR_CLASSES` and a message, and may be retried under a
per-class :class:`RetryPolicy`.

Why one module of ~630 lines: the rollout's states, its errors and deadlines
and the engine that opens, retries and releases it are one lifecycle; the
ownership rules above are checkable only while they sit together.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import trio

from lowwater._native import LowwaterError
from lowwater.environment import HARNESSES, Environment, HarnessContext, Score, Task
from lowwater.trajectory import Trajectory, TrajectoryRegistry

if TYPE_CHECKING:  # pragma: no cover
    import os
    from collections.abc import Mapping, Sequence

    from lowwater.interception import InterceptionServer
    from lowwater.interception.slots import Slot
    from lowwater.plugins import Plugins
    from lowwater.runtime import Runtime, RuntimeConfig, RuntimePool

log = logging.getLogger("lowwater.rollout")

#: Error classes, in the order the summary lists them.
ERROR_CLASSES = ("infra", "model", "environment", "timeout", "cancelled")


@attrs.frozen
class RolloutError:
    """Why a rollout failed: ``cls`` (one of :data:`ERROR_CLASSES`) and ``message``."""

    cls: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"class": self.cls, "message": self.message}


class RolloutFailed(LowwaterError):
    """Raised by harnesses and rubrics to fail a rollout with a given error class.

    Args:
        error_class: one of :data:`ERROR_CLASSES`.
        message: a one-line reason.
    """

    def __init__(self, error_class: str, message: str) -> None:
        if error_class not in ERROR_CLASSES:
            raise ValueError(f"error class must be one of {ERROR_CLASSES}, not {error_class!r}")
        super().__init__(message)
        self.error_class = error_class
        self.message = message


def classify(exc: BaseException) -> RolloutError:
    """Map an exception escaping a rollout phase to a :class:`RolloutError`.

    Model-call failures (HTTP errors talking to the interception server or
    upstream) are ``model``; runtime and OS failures are ``infra``; deadline
    expiry is ``timeout``; anything else the environment raised is
    ``environment``.
    """
    try:
        from lowwater.runtime import base as runtime_base  # lazy: keeps import light
    except ImportError:  # the runtime plugin's package is absent
        runtime_base = None  # type: ignore[assignment]  # a module or nothing; checked below

    if isinstance(exc, RolloutFailed):
        return RolloutError(exc.error_class, exc.message)
    message = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, trio.TooSlowError):
        return RolloutError("timeout", message)
    if isinstance(exc, httpx.HTTPError):
        return RolloutError("model", message)
    # Provisioning failures and crashed warm workers are the infrastructure's
    # fault, not the environment's: they are retried under the infra budget.
    runtime_errors = tuple(
        getattr(runtime_base, n) for n in ("RuntimeStartError", "WarmWorkerCrashed") if hasattr(runtime_base, n)
    )
    if runtime_errors and isinstance(exc, runtime_errors):
        return RolloutError("infra", message)
    if isinstance(exc, OSError):
        return RolloutError("infra", message)
    return RolloutError("environment", message)


@attrs.frozen
class Deadlines:
    """Deadlines in seconds (``None``: none).

    Attributes:
        rollout_s: the whole rollout, from the moment it starts work.
        setup_s: ``open`` (slot registration, runtime provisioning when eager).
        agent_s: the harness.
        scoring_s: the rubric.
        cleanup_s: the shielded cleanup (always runs, bounded by this).
    """

    rollout_s: float | None = 600.0
    setup_s: float | None = 120.0
    agent_s: float | None = None
    scoring_s: float | None = 120.0
    cleanup_s: float = 30.0


@attrs.frozen
class RetryPolicy:
    """How many extra attempts each error class gets (``cancelled`` never retries)."""

    infra: int = 2
    model: int = 2
    environment: int = 0
    timeout: int = 0

    def allows(self, error: RolloutError, attempt: int) -> bool:
        """True if a rollout that failed with ``error`` on 1-based ``attempt`` runs again."""
        if error.cls == "cancelled":
            return False
        return attempt <= getattr(self, error.cls, 0)


@attrs.define(eq=False)
class Rollout:
    """One run of one task.

    Attributes:
        rollout_id: unique within the run.
        task: the task.
        group_id: the group's id, or ``None``.
        attempt: 1-based attempt number (retries increment it).
        trajectory: the turns recorded so far (``None`` after eviction).
        state: the environment's scratch space for its harness and rubric
            (final answer, ...): the engine never reads or writes it, except
            to empty it before a retried attempt.
        reward: the score's reward (``None`` until scored).
        metrics: the score's metrics.
        error: ``None`` or the :class:`RolloutError` of the last attempt.
        timing: seconds spent per phase (``setup_s``, ``agent_s``,
            ``scoring_s``, ``cleanup_s``, ``total_s``).
        turn_count: turns of the last attempt (kept after eviction).
        slot: the interception :class:`~lowwater.interception.slots.Slot` of
            the running attempt (``base_url``, ``secret``); set by the engine
            at open, ``None`` once it unregistered the slot at the attempt's
            end (every exit path).
        context: the :class:`~lowwater.environment.HarnessContext` the
            running attempt's harness got; ``None`` before the harness starts
            and after the attempt's end.
    """

    rollout_id: str
    task: Task
    group_id: str | None = None
    attempt: int = 1
    trajectory: Trajectory | None = None
    state: dict[str, Any] = attrs.field(factory=dict)
    reward: float | None = None
    metrics: dict[str, Any] = attrs.field(factory=dict)
    error: RolloutError | None = None
    timing: dict[str, float] = attrs.field(factory=dict)
    turn_count: int = 0
    slot: Slot | None = attrs.field(default=None, repr=False)
    context: HarnessContext | None = attrs.field(default=None, repr=False)
    _runtime_getter: Callable[[], Awaitable[Runtime]] | None = attrs.field(
        default=None, repr=False, alias="runtime_getter"
    )

    async def runtime(self) -> Runtime:
        """The rollout's runtime (taken on first use, released at close);
        rubrics use it to run scoring scripts, warm when it is persistent.

        Raises:
            RolloutFailed: the engine has no runtime configured.
            lowwater.runtime.RuntimeStartError: provisioning failed.
        """
        if self._runtime_getter is None:
            raise RolloutFailed("infra", "this rollout has no runtime")
        return await self._runtime_getter()

    async def run_script(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> str:
        """Run a script exposing ``main(argv: list[str]) -> str`` in the
        rollout's runtime (:meth:`lowwater.runtime.Runtime.run_script`); its result.

        Warm on a persistent runtime (the script is imported once per runtime,
        then called per rollout); cold on an ephemeral one, which would pay a
        warm worker's start for a single call.

        Args:
            script: the script's path.
            args: its ``argv``.
            env: variables set for this call only.
            timeout: seconds before the call is killed; ``None``: no limit.

        Raises:
            RolloutFailed: the engine has no runtime configured.
            lowwater.runtime.ScriptError: the script failed.
            lowwater.runtime.ProgramTimeout: ``timeout`` expired.
        """
        runtime = await self.runtime()
        warm = bool(getattr(getattr(runtime, "config", None), "persistent", False))
        return await runtime.run_script(script, args, env=env, warm=warm, timeout=timeout)

    def result(self) -> dict[str, Any]:
        """The result row (JSON-serialisable); see ``docs/eval.md`` for the keys."""
        return {
            "task_id": self.task.id,
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "attempt": self.attempt,
            "reward": self.reward,
            "metrics": self.metrics,
            "turns": self.turn_count,
            "error": None if self.error is None else self.error.to_json(),
            "timing": self.timing,
        }


@attrs.define(eq=False)
class Group:
    """``n`` rollouts of one task, scored together.

    Attributes:
        group_id: unique within the run.
        task: the task.
        rollouts: the members, in creation order.
        registry: the trajectory registry (members' trajectories stay
            readable here until the group is cleaned up).
    """

    group_id: str
    task: Task
    rollouts: list[Rollout]
    registry: TrajectoryRegistry

    def trajectories(self) -> list[Trajectory]:
        return self.registry.group(self.group_id)


ResultSink = Callable[[Rollout], Awaitable[None]]


class Engine:
    """Runs rollouts and groups of one environment.

    The engine owns the trajectory registry and, for its rollouts, their
    interception slots and runtimes; it alone releases them, on every exit
    path (success, error, cancellation, deadline), shielded under
    ``deadlines.cleanup_s``, before :meth:`run_rollout` / :meth:`run_group`
    return or raise.  Lifecycle hooks see a rollout's trajectory at
    ``rollout_end`` and a group's at ``group_end``; cleanup policies run
    after the eviction.

    Args:
        env: the environment.
        interceptor: a running :class:`lowwater.interception.InterceptionServer`.
        plugins: the loaded plugins (lifecycle hooks and cleanup policies).
        http: the client in-process harnesses use to call the interceptor.
        harness: ``"inprocess"`` or ``"program"``.
        model: the model name harnesses put in their requests.
        max_turns: model calls per rollout the harness may make.
        deadlines: see :class:`Deadlines`.
        retry: see :class:`RetryPolicy`.
        runtime_config: the runtime to provision on first use.
        pool: a :class:`lowwater.runtime.RuntimePool` when runtimes are
            persistent; ``None`` starts an ephemeral runtime per rollout.
        program: an agent program's argv run instead of the environment's
            harness (``--program``; :mod:`lowwater.program_harness`), or ``None``.

    Raises:
        ValueError: an unknown harness.
    """

    def __init__(
        self,
        env: Environment,
        interceptor: InterceptionServer,
        plugins: Plugins,
        http: httpx.AsyncClient,
        *,
        harness: str = "inprocess",
        model: str = "scripted",
        max_turns: int = 16,
        deadlines: Deadlines = Deadlines(),
        retry: RetryPolicy = RetryPolicy(),
        runtime_config: RuntimeConfig | None = None,
        pool: RuntimePool | None = None,
        program: tuple[str, ...] | None = None,
    ) -> None:
        if harness not in HARNESSES:
            raise ValueError(f"harness must be one of {HARNESSES}, not {harness!r}")
        self.env = env
        self.interceptor = interceptor
        self.plugins = plugins
        self.http = http
        self.harness = harness
        self.model = model
        self.max_turns = max_turns
        self.deadlines = deadlines
        self.retry = retry
        self.runtime_config = runtime_config
        self.pool = pool
        self.program = program
        self.registry = TrajectoryRegistry()
        #: Runtimes currently held by a rollout (rollout id -> runtime).
        self.runtimes: dict[str, Runtime] = {}
        self.in_flight = 0

    # -- public -----------------------------------------------------------------

    async def run_rollout(
        self, task: Task, *, on_result: ResultSink | None = None, rollout_id: str | None = None
    ) -> Rollout:
        """Run one ungrouped rollout of ``task`` to the end (with retries).

        ``on_result`` is awaited with the finished rollout (success or
        error, and on cancellation) before the ``rollout_end`` hooks and
        before its trajectory is evicted; the eval runner writes the row
        there.  Cancellation propagates after cleanup.
        """
        rollout = self._new_rollout(rollout_id or _new_id("r"), task, None)
        try:
            await self._attempts(rollout)
        finally:
            with _cleanup_scope(self.deadlines.cleanup_s):
                try:
                    if on_result is not None:
                        await on_result(rollout)
                    await self.plugins.fire_hooks("rollout_end", rollout=rollout)
                finally:
                    self._evict(rollout)
                await self.plugins.fire_policies("rollout_end", rollout=rollout)
        return rollout

    async def run_group(
        self,
        task: Task,
        n: int,
        *,
        on_result: ResultSink | None = None,
        on_group: Callable[[Group], Awaitable[None]] | None = None,
        group_id: str | None = None,
    ) -> Group:
        """Run ``n`` rollouts of ``task`` concurrently, then the group reward.

        Members are scored individually and their own cleanup (slot,
        runtime, ``rollout_end``) runs as each finishes; their trajectories
        stay in the registry until the group is cleaned up, after the group
        reward, ``on_result`` for each member, ``on_group`` (a trainer's
        producer turns the trajectories into shards there) and ``group_end``.

        Raises:
            ValueError: ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"group size must be >= 1, not {n}")
        group_id = group_id or _new_id("g")
        group = Group(
            group_id, task, [self._new_rollout(f"{group_id}-{i}", task, group_id) for i in range(n)], self.registry
        )
        try:
            async with trio.open_nursery() as nursery:
                for rollout in group.rollouts:
                    nursery.start_soon(self._member, rollout)
            await self._group_reward(group)
        finally:
            with _cleanup_scope(self.deadlines.cleanup_s):
                try:
                    if on_result is not None:
                        for rollout in group.rollouts:
                            await on_result(rollout)
                    if on_group is not None:
                        await on_group(group)
                    await self.plugins.fire_hooks("group_end", group=group)
                finally:
                    self._evict_group(group)
                await self.plugins.fire_policies("group_end", group=group)
        return group

    def _new_rollout(self, rollout_id: str, task: Task, group_id: str | None) -> Rollout:
        rollout = Rollout(rollout_id, task, group_id)
        rollout._runtime_getter = lambda: self._runtime_for(rollout)
        return rollout

    def stats(self) -> dict[str, Any]:
        """``in_flight`` rollouts, held ``runtimes``, and the registry's stats."""
        return {"in_flight": self.in_flight, "runtimes": len(self.runtimes), **self.registry.stats()}

    # -- lifecycle ----------------------------------------------------------------

    async def _member(self, rollout: Rollout) -> None:
        try:
            await self._attempts(rollout)
        finally:
            with _cleanup_scope(self.deadlines.cleanup_s):
                await self.plugins.fire("rollout_end", rollout=rollout)

    async def _group_reward(self, group: Group) -> None:
        scored = [r for r in group.rollouts if r.error is None]
        if not scored:
            return
        try:
            with _fail_after(self.deadlines.scoring_s):
                rewards = await self.env.group_reward(group)
        except Exception as exc:
            error = classify(exc)
            for rollout in scored:
                rollout.error = RolloutError(error.cls, f"group reward: {error.message}")
            return
        if rewards is None:
            return
        if len(rewards) != len(group.rollouts):
            for rollout in scored:
                rollout.error = RolloutError(
                    "environment", f"group reward returned {len(rewards)} values for {len(group.rollouts)} rollouts"
                )
            return
        for rollout, reward in zip(group.rollouts, rewards, strict=True):
            if rollout.error is None:
                rollout.reward = float(reward)

    async def _attempts(self, rollout: Rollout) -> None:
        """Attempt the rollout until it succeeds or its error class runs out of retries."""
        self.in_flight += 1
        try:
            while True:
                await self._attempt(rollout)
                if rollout.error is None or not self.retry.allows(rollout.error, rollout.attempt):
                    return
                log.info(
                    "rollout %s attempt %d failed (%s); retrying",
                    rollout.rollout_id,
                    rollout.attempt,
                    rollout.error.cls,
                )
                self.registry.discard(rollout.rollout_id)
                rollout.attempt += 1
                rollout.error = None
                rollout.state.clear()
        finally:
            self.in_flight -= 1

    async def _attempt(self, rollout: Rollout) -> None:
        started = time.perf_counter()
        rollout.timing.clear()
        rollout.reward, rollout.metrics = None, {}
        # The whole-rollout deadline starts here, when the rollout starts work.
        with _move_on_after(self.deadlines.rollout_s) as whole:
            try:
                await self._open(rollout)
                await self.plugins.fire("rollout_start", rollout=rollout)
                await self._phase(rollout, "agent_s", self.deadlines.agent_s, self._run_harness)
                failed_turn = _failed_turn(rollout.trajectory)
                if failed_turn is not None:
                    raise RolloutFailed("model", f"turn {failed_turn.index}: {failed_turn.error}")
                await self._phase(rollout, "scoring_s", self.deadlines.scoring_s, self._score)
            except trio.Cancelled:
                if not whole.cancel_called:
                    rollout.error = RolloutError("cancelled", "rollout cancelled")
                raise
            except Exception as exc:
                rollout.error = classify(exc)
            finally:
                cleanup_start = time.perf_counter()
                with _cleanup_scope(self.deadlines.cleanup_s):
                    await self._release(rollout)
                rollout.timing["cleanup_s"] = time.perf_counter() - cleanup_start
        if whole.cancelled_caught:
            rollout.error = RolloutError("timeout", f"rollout deadline of {self.deadlines.rollout_s} s expired")
        if rollout.trajectory is not None:
            rollout.turn_count = len(rollout.trajectory.turns)
        rollout.timing["total_s"] = time.perf_counter() - started

    async def _open(self, rollout: Rollout) -> None:
        start = time.perf_counter()
        rollout.trajectory = self.registry.open(rollout.rollout_id, task_id=rollout.task.id, group_id=rollout.group_id)
        rollout.slot = self.interceptor.register(rollout.trajectory)
        rollout.timing["setup_s"] = time.perf_counter() - start

    async def _phase(
        self, rollout: Rollout, key: str, deadline: float | None, fn: Callable[[Rollout], Awaitable[None]]
    ) -> None:
        start = time.perf_counter()
        try:
            with _fail_after(deadline):
                await fn(rollout)
        finally:
            rollout.timing[key] = time.perf_counter() - start

    async def _run_harness(self, rollout: Rollout) -> None:
        slot = rollout.slot
        assert slot is not None  # _open set it; only _release clears it
        ctx = HarnessContext(
            task=rollout.task,
            base_url=slot.base_url,
            api_key=slot.secret,
            model=self.model,
            max_turns=self.max_turns,
            harness=self.harness,
            http=self.http,
            rollout=rollout,
        )
        rollout.context = ctx
        if self.program is not None:
            from lowwater.program_harness import run_program  # lazy: only program runs need it

            await run_program(ctx, self.program)
            return
        await self.env.harness(ctx)

    async def _score(self, rollout: Rollout) -> None:
        score = await self.env.score(rollout)
        if not isinstance(score, Score):
            raise RolloutFailed("environment", f"score() returned {type(score).__name__}, not Score")
        rollout.reward = float(score.reward)
        rollout.metrics = dict(score.metrics)

    async def _runtime_for(self, rollout: Rollout) -> Runtime:
        held = self.runtimes.get(rollout.rollout_id)
        if held is not None:
            return held
        if self.runtime_config is None:
            raise RolloutFailed("infra", "this engine has no runtime configured")
        runtime: Runtime
        if self.pool is not None:
            runtime = await self.pool.acquire(self.runtime_config)
        else:
            factory = self.plugins.runtime(self.runtime_config.kind)
            runtime = factory(self.runtime_config)
            try:
                await runtime.start()
            except BaseException:
                with _cleanup_scope(self.deadlines.cleanup_s):
                    await runtime.stop()
                raise
        self.runtimes[rollout.rollout_id] = runtime
        return runtime

    async def _release(self, rollout: Rollout) -> None:
        """The one release point of an attempt's slot and runtime (run shielded
        at the end of every attempt): unregister the slot, which sweeps its
        undelivered intercepts and answers their handlers, and release the runtime."""
        slot, rollout.slot, rollout.context = rollout.slot, None, None
        if slot is not None:
            swept = self.interceptor.unregister(slot.rollout_id)
            if swept:
                log.debug("rollout %s: swept %d undelivered intercepts", rollout.rollout_id, swept)
        runtime = self.runtimes.pop(rollout.rollout_id, None)
        if runtime is None:
            return
        try:
            if self.pool is not None:
                await self.pool.release(runtime)
            else:
                await runtime.stop()
        except Exception:
            log.exception("rollout %s: releasing its runtime failed", rollout.rollout_id)

    def _evict(self, rollout: Rollout) -> None:
        """The eviction point of an ungrouped trajectory: rollout close."""
        self.registry.close_rollout(rollout.rollout_id)
        rollout.trajectory = None

    def _evict_group(self, group: Group) -> None:
        """The eviction point of grouped trajectories: group cleanup, after the
        group reward, the result sink, ``on_group`` and the ``group_end`` hooks
        (docs/design.md#review-findings: scoring reads them after each member's cleanup)."""
        self.registry.close_group(group.group_id)
        for rollout in group.rollouts:
            rollout.trajectory = None


def _failed_turn(trajectory: Trajectory | None) -> Any:
    if trajectory is None:
        return None
    return next((t for t in trajectory.turns if t.error), None)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _cleanup_scope(deadline_s: float) -> trio.CancelScope:
    """A shielded scope with its own deadline: cleanup runs even when the
    rollout was cancelled, and cannot hang the run."""
    return trio.CancelScope(shield=True, deadline=trio.current_time() + deadline_s)


def _fail_after(seconds: float | None) -> AbstractContextManager[trio.CancelScope]:
    return trio.fail_after(seconds) if seconds is not None else trio.CancelScope()


def _move_on_after(seconds: float | None) -> AbstractContextManager[trio.CancelScope]:
    return trio.move_on_after(seconds) if seconds is not None else trio.CancelScope()
