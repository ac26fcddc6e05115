"""The trainer API: a trainer's loop asks lowwater for groups of rollouts,
receives their token data as shard references, and releases every byte of
the step with :meth:`Lowwater.clear_batch`.

Async (Trio trainers)::

    async with Lowwater.open(TrainerConfig(group_size=4)) as lw:
        for step in range(100):
            batch = await lw.next_batch(n_groups=8)   # Batch: refs, rewards, step
            ...                                        # consumers fetch batch.refs
            await lw.clear_batch(batch, consumers=["127.0.0.1:9001"])

Sync (any other trainer): :class:`SyncLowwater` runs the same object on a
Trio loop in a background thread; its methods block the calling thread only.

What lowwater holds between ``next_batch`` and ``clear_batch`` is exactly the
batch's shards in the producer's :class:`~lowwater.trainer.shards.ShardStore`; the
rollouts' trajectories are evicted when each group has been turned into
shards (docs/design.md#incidents: consumer fetch buffers that only the controller
drained grew ~2 GB per step).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import httpx
import trio

from lowwater import _validate as v
from lowwater import plugins as plugins_mod
from lowwater._native import LowwaterError
from lowwater.assembly import EngineConfig, engine_runtime_config, open_engine, program_argv
from lowwater.environment import HARNESSES, Environment, Task
from lowwater.excgroups import unwrapped
from lowwater.rollout import Engine, Group
from lowwater.trainer.drain import DrainReport, clear_batch
from lowwater.trainer.pooled import GroupPool
from lowwater.trainer.producer import group_shards
from lowwater.trainer.shards import ShardRef, ShardStore
from lowwater.upstream.spec import ModelSpec, model_server

T = TypeVar("T")


class TrainerClosed(LowwaterError):
    """The :class:`Lowwater` instance was shut down (or never started)."""


@attrs.frozen
class TrainerConfig:
    """How a trainer runs lowwater.

    Attributes:
        env: environment name; ``env_options`` its options.
        model: the upstream model (``ModelSpec``; default: the scripted model).
        group_size: rollouts per task (``>= 1``).
        concurrency: groups in flight at once while filling a batch.
        max_turns: model calls per rollout.
        timeout_s: whole-rollout deadline (seconds).
        harness: ``"inprocess"`` or ``"program"``.
        request_logprobs: ask the upstream for token ids and logprobs on every
            intercepted call (trainers need them; evals do not).
        workers: env worker processes (0: every group in this process;
            per node on a multi-node backend).  With workers, the groups run
            in one pool of the configured backend that lives as long as this
            :class:`Lowwater`: workers are kept across steps, and one due to
            retire (``max_rss_mb``, ``max_tasks_per_worker``) exits only once
            every step whose groups it ran has been cleared.  Each worker
            hands its groups' shards to this process (the local backend:
            uploaded to this process's shard store; ``ray``: object-store
            objects this process owns), so a worker that dies loses nothing
            (its group is re-run from the task id).
        max_rss_mb: a worker retires past this current RSS (MiB; ``None``: never).
        max_tasks_per_worker: a worker retires after this many groups
            (jittered; ``None``: never by count).
        backend: the worker backend (``register_backends``): ``"local"`` or
            a plugin's (``"ray"``); anything but ``"local"`` needs ``workers``.
        ray_address: the cluster the backend joins (``ray``: ``"auto"`` or
            ``HOST:PORT``; ``None``: the backend's default).
        bind, advertise: where the model server the trainer starts
            (scripted, replay) binds and the host its URL names; beyond
            loopback it needs ``LOWWATER_ADMIN_KEY`` (the workers send it).  A
            remote backend (``ray``) refuses a loopback-only model server.
        runtime: the runtime agent programs and scripts run in (a
            ``register_runtimes`` name; ``None``: the environment's, else
            ``"subprocess"``; :mod:`lowwater.runtime_choice`).
        runtime_options: its options, over the environment's key by key.
        program: with ``harness="program"``, a command line run as the agent
            instead of the environment's harness (:mod:`lowwater.program_harness`).

    Raises:
        ValueError: a count or timeout out of range, an unknown harness, a
            backend other than ``"local"`` without workers.
    """

    env: str = "arithmetic"
    env_options: dict[str, Any] = attrs.field(factory=dict)
    model: ModelSpec = ModelSpec("scripted", "scripted")
    group_size: int = attrs.field(default=4, validator=v.at_least(1))
    concurrency: int = attrs.field(default=8, validator=v.at_least(1))
    max_turns: int = attrs.field(default=16, validator=v.at_least(1))
    timeout_s: float = attrs.field(default=600.0, validator=v.positive(unit="seconds"))
    harness: str = attrs.field(default="inprocess", validator=v.one_of(HARNESSES))
    request_logprobs: bool = True
    workers: int = attrs.field(default=0, validator=v.at_least(0))
    max_rss_mb: float | None = attrs.field(default=None, validator=v.optional(v.positive()))
    max_tasks_per_worker: int | None = attrs.field(default=None, validator=v.optional(v.at_least(1)))
    backend: str = attrs.field(default="local", validator=v.backend_needs_workers("backend {!r}", "workers=K"))
    ray_address: str | None = None
    bind: str = "127.0.0.1"
    advertise: str | None = None
    runtime: str | None = None
    runtime_options: dict[str, Any] = attrs.field(factory=dict)
    program: str | None = attrs.field(default=None, validator=v.program_needs_harness)

    def engine(self) -> EngineConfig:
        """The engine settings each env worker runs with."""
        return EngineConfig(
            env=self.env,
            env_options=self.env_options,
            model=self.model,
            group_size=self.group_size,
            concurrency=max(self.concurrency * self.group_size, 1),
            max_turns=self.max_turns,
            timeout_s=self.timeout_s,
            harness=self.harness,
            runtime=self.runtime,
            runtime_options=self.runtime_options,
            program=self.program,
        )


@attrs.frozen
class Batch:
    """One step's data.

    Attributes:
        step: 0-based step number.
        refs: shard references, six per group in
            :data:`lowwater.trainer.producer.SHARD_NAMES` order.
        rewards: per group, the members' rewards (float; errored rollouts 0).
        task_ids: per group, the task id.
        errors: rollouts of the batch that failed (they carry ``loss_mask`` 0).
    """

    step: int
    refs: tuple[ShardRef, ...]
    rewards: tuple[tuple[float, ...], ...]
    task_ids: tuple[Any, ...]
    errors: int

    @classmethod
    def assemble(
        cls, step: int, groups: Sequence[tuple[Any, Sequence[ShardRef], tuple[float, ...], int] | None]
    ) -> Batch:
        """A batch from per-group ``(task_id, refs, rewards, errors)`` tuples, in order (``None``: no group)."""
        done = [g for g in groups if g is not None]
        return cls(
            step=step,
            refs=tuple(ref for g in done for ref in g[1]),
            rewards=tuple(g[2] for g in done),
            task_ids=tuple(g[0] for g in done),
            errors=sum(g[3] for g in done),
        )

    @property
    def shard_ids(self) -> list[str]:
        return [r.shard_id for r in self.refs]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.refs)


class Lowwater:
    """A running lowwater for a trainer (use :meth:`open`)."""

    def __init__(
        self,
        config: TrainerConfig,
        engine: Engine | None,
        store: ShardStore,
        http: httpx.AsyncClient,
        plugins: Any,
        *,
        env: Environment | None = None,
        upstream_url: str = "",
    ) -> None:
        self.config = config
        self.engine = engine  # None with workers: the engines run in the workers
        self.store = store
        self.http = http
        self.plugins = plugins
        self.step = 0
        if env is None:
            if engine is None:
                raise TypeError("Lowwater needs its engine, or the environment when the engines run in workers")
            env = engine.env
        self.env = env
        self._tasks = _cycle(self.env)
        self._upstream_url = upstream_url
        self.closed = False
        self.pool_reports: list[dict[str, Any]] = []
        self.pool_report: dict[str, Any] | None = None
        self.groups: GroupPool | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, config: TrainerConfig = TrainerConfig(), *, plugins: Any = None) -> AsyncIterator[Lowwater]:
        """Start the model (if local), the interception server and the shard
        store; yield a :class:`Lowwater`; shut everything down on exit.

        An exception raised in the ``async with`` body, or by a method
        (``lowwater.BufferFull`` from :meth:`next_batch`), comes out as
        itself, not wrapped in the nurseries' exception groups; only several
        failing at once stay a group.

        Raises:
            lowwater.plugins.UnknownName: unknown environment.
            lowwater.upstream.spec.UpstreamError: the model cannot be started/reached.
        """
        try:
            async with cls._open(config, plugins) as lw:
                yield lw
        except BaseExceptionGroup as group:
            # The trainer's nurseries wrap an error once per nursery it
            # passes (two for one raised in the `async with` body, or in
            # next_batch): a trainer catching `lowwater.BufferFull`, or its
            # own exception, must get that exception, not groups around it.
            error = unwrapped(group)
            if error is None:
                raise
        else:
            return
        raise error

    @classmethod
    @asynccontextmanager
    async def _open(cls, config: TrainerConfig, plugins: Any) -> AsyncIterator[Lowwater]:
        plugins = plugins or plugins_mod.load()
        from lowwater.http.exposure import reachable_config  # lazy: the HTTP stack only for runs

        config = reachable_config(config, plugins)
        env: Environment = plugins.environment(config.env)(config.env_options)
        store = ShardStore()
        try:
            await _preflight(config, env, plugins)
            async with (
                model_server(config.model, host=config.bind, advertise=config.advertise) as url,
                trio.open_nursery() as nursery,
            ):
                await nursery.start(store.run)  # with its bulk listener (trainer/bulk.py)
                async with cls._start(config, env, plugins, store, url, nursery) as lw:
                    try:
                        yield lw
                    finally:
                        lw.closed = True
                        with trio.CancelScope(shield=True):
                            if lw.groups is not None:
                                with trio.move_on_after(_POOL_STOP_S):
                                    await lw.groups.aclose()  # workers exit; the pool's own deadlines apply
                                lw.pool_report = lw.groups.report
                            await plugins.fire("shutdown")
                nursery.cancel_scope.cancel()
        finally:
            store.buffer.clear()
            with trio.CancelScope(shield=True):
                await env.aclose()

    @classmethod
    @asynccontextmanager
    async def _start(
        cls, config: TrainerConfig, env: Environment, plugins: Any, store: ShardStore, url: str, nursery: trio.Nursery
    ) -> AsyncIterator[Lowwater]:
        """Without workers, an engine in this process, assembled as every
        engine is (:func:`lowwater.assembly.open_engine`, ephemeral runtimes);
        with workers, the group pool, started in ``nursery``."""
        if not config.workers:
            engine_config = attrs.evolve(config.engine(), persistent=False)
            opened = open_engine(engine_config, env, plugins, url, request_logprobs=config.request_logprobs)
            async with opened as (engine, _server):
                yield cls(config, engine, store, engine.http, plugins, env=env)
            return
        from lowwater.upstream.agent_client import AgentClient

        # The trainer's own client: clear_batch's calls to the consumers.
        async with AgentClient(
            max_idle=max(config.concurrency * config.group_size, 8), timeout_s=config.timeout_s
        ) as http:
            lw = cls(config, None, store, http, plugins, env=env, upstream_url=url)
            lw.groups = GroupPool(config, plugins, url, store)
            nursery.start_soon(lw.groups.run)
            yield lw

    async def next_batch(self, n_groups: int) -> Batch:
        """Run ``n_groups`` groups of ``group_size`` rollouts and return their shards.

        Raises:
            TrainerClosed: after shutdown.
            ValueError: ``n_groups < 1``.
            lowwater.BufferFull: the shard store is at capacity.
        """
        if self.closed:
            raise TrainerClosed("lowwater was shut down")
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, not {n_groups}")
        step = self.step
        self.step += 1
        if self.engine is None:
            return await self._next_batch_pooled(step, n_groups)
        engine = self.engine  # not None past the check above, and a closure needs it so typed
        slots: list[tuple[Any, list[ShardRef], tuple[float, ...], int] | None] = [None] * n_groups
        limiter = trio.CapacityLimiter(self.config.concurrency)

        async def one(i: int, task: Task) -> None:
            refs: list[ShardRef] = []

            async def produce(group: Group) -> None:
                # Before group_end and eviction: the trajectories are still live.
                trajectories = {t.rollout_id: t for t in group.trajectories()}
                refs.extend(group_shards(self.store, f"step{step}/{group.group_id}", group.rollouts, trajectories))

            async with limiter:
                group = await engine.run_group(task, self.config.group_size, on_group=produce, group_id=f"s{step}-g{i}")
            slots[i] = (
                task.id,
                refs,
                tuple(r.reward or 0.0 for r in group.rollouts),
                sum(r.error is not None for r in group.rollouts),
            )

        try:
            async with trio.open_nursery() as nursery:
                for i in range(n_groups):
                    nursery.start_soon(one, i, next(self._tasks))
        except BaseExceptionGroup as group:
            error = unwrapped(group)  # one group's error is the error the docstring names
            if error is None:
                raise
        else:
            return Batch.assemble(step, slots)
        raise error

    async def clear_batch(
        self, batch: Batch | Sequence[ShardRef | str], *, consumers: Sequence[str] = ()
    ) -> DrainReport:
        """Release the batch everywhere: this process's shard store removes its
        copies, every consumer (``host:port``) drains exactly those ids, and
        ``step_end`` fires (a guarded ``malloc_trim`` among its policies).

        Never raises for an unreachable consumer (it is logged): a failing
        stats call must not break training.
        """
        items = list(batch.refs) if isinstance(batch, Batch) else list(batch)
        report = await clear_batch(items, client=self.http, consumers=consumers, local=self.store)
        ids = [r.shard_id if isinstance(r, ShardRef) else r for r in items]
        if self.groups is not None:
            # Only now may the workers that produced the step retire.
            for step in {batch.step} if isinstance(batch, Batch) else _steps_of(ids):
                self.groups.release(step)
        await self.plugins.fire(
            "step_end", step=batch.step if isinstance(batch, Batch) else self.step - 1, shard_ids=ids
        )
        return report

    async def _next_batch_pooled(self, step: int, n_groups: int) -> Batch:
        """The batch's groups in the env workers (see :class:`TrainerConfig`).

        Raises:
            lowwater.workers.WorkerStartError: workers keep failing to start.
        """
        assert self.groups is not None
        slots, summary = await self.groups.run_groups(step, [next(self._tasks) for _ in range(n_groups)])
        self.pool_reports.append(summary)
        return Batch.assemble(step, slots)

    def stats(self) -> dict[str, Any]:
        """``shards`` (the store's fetch-buffer stats) and, without workers,
        ``engine`` (registry, in-flight) and ``intercepts``; with workers,
        ``pool`` (the live pool stats, per worker)."""
        if self.engine is None:
            pool = self.groups.stats() if self.groups is not None else None
            return {"shards": self.store.stats(), "engine": None, "intercepts": None, "pool": pool}
        return {
            "shards": self.store.stats(),
            "engine": self.engine.stats(),
            "intercepts": self.engine.interceptor.table.stats(),
        }


#: Seconds the pool gets to stop its workers when the trainer closes.
_POOL_STOP_S = 60.0


async def _preflight(config: TrainerConfig, env: Environment, plugins: Any) -> None:
    """Choose and validate the in-process engine's runtime before anything
    starts; a ``program`` that cannot start raises
    :class:`lowwater.program_harness.ProgramStartError` here, not per rollout."""
    engine_config = attrs.evolve(config.engine(), persistent=False)
    runtime_config = engine_runtime_config(engine_config, env, plugins)
    argv = program_argv(engine_config)
    if runtime_config is not None and argv is not None:
        from lowwater.program_harness import preflight

        await preflight(plugins, runtime_config, argv, model=config.model.name)


def _steps_of(shard_ids: Sequence[str]) -> set[int]:
    """Steps named by shard ids (``step{N}/...``, as the producer names them)."""
    steps = set()
    for shard_id in shard_ids:
        head = shard_id.partition("/")[0]
        if head.startswith("step") and head[4:].isdigit():
            steps.add(int(head[4:]))
    return steps


def _cycle(env: Environment) -> Any:
    while True:
        empty = True
        for task in env.tasks():
            empty = False
            yield task
        if empty:
            raise LowwaterError(f"environment {env.name!r} has no tasks")


class SyncLowwater:
    """:class:`Lowwater` for trainers that are not Trio programs.

    A background thread runs Trio; each method submits the async call to it
    and blocks the calling thread until it returns (exceptions re-raised).
    Use as a context manager, or call :meth:`close`.

    Raises:
        Whatever :meth:`Lowwater.open` raises, from the constructor.
    """

    def __init__(self, config: TrainerConfig = TrainerConfig()) -> None:
        self._calls: queue.Queue[Any] = queue.Queue()
        started: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(
            target=trio.run, args=(self._main, config, started), name="lowwater-trio", daemon=True
        )
        self._thread.start()
        error = started.get()
        if error is not None:
            self._thread.join()
            raise error
        self._closed = False

    async def _main(self, config: TrainerConfig, started: queue.Queue[BaseException | None]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with Lowwater.open(config) as lw:
                self.lw = lw
                started.put(None)
                await self._stop.wait()
        except BaseException as exc:  # reported to the constructor if startup failed
            if not hasattr(self, "lw"):
                started.put(exc)
                return
            raise

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise TrainerClosed("SyncLowwater was closed")
        return trio.from_thread.run(lambda: fn(*args, **kwargs), trio_token=self._token)

    def next_batch(self, n_groups: int) -> Batch:
        batch: Batch = self._call(self.lw.next_batch, n_groups)
        return batch

    def clear_batch(self, batch: Batch | Sequence[ShardRef | str], *, consumers: Sequence[str] = ()) -> DrainReport:
        report: DrainReport = self._call(self.lw.clear_batch, batch, consumers=consumers)
        return report

    def stats(self) -> dict[str, Any]:
        return trio.from_thread.run_sync(self.lw.stats, trio_token=self._token)

    def close(self) -> None:
        """Shut lowwater down and join its thread (idempotent)."""
        if self._closed:
            return
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()
        self._closed = True

    def __enter__(self) -> SyncLowwater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
