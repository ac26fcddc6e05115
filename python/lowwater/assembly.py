"""Engine assembly: an :class:`~lowwater.rollout.Engine` with its model
client, interception server, agent HTTP client and runtime pool, started
and stopped together.

Both the eval runner (:mod:`lowwater.eval`) and the trainer API
(:mod:`lowwater.trainer`) build engines here, in this process or in env
workers (:class:`EngineJob`), so neither layer imports the other.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from lowwater import _validate as v
from lowwater import plugins as plugins_mod
from lowwater.environment import HARNESSES, Environment
from lowwater.rollout import Deadlines, Engine
from lowwater.upstream.spec import ModelSpec
from lowwater.workers import WorkerJob

log = logging.getLogger("lowwater.engine")


@attrs.frozen
class EngineConfig:
    """What defines an engine: the environment, the model and how rollouts run.

    Attributes:
        env: environment name (``register_environments``).
        env_options: options for the environment's factory.
        model: the upstream model (``ModelSpec``).
        group_size: rollouts per task (a group when > 1).
        concurrency: rollouts in flight at once (sizes the agent HTTP
            client's keep-alive pool and the runtime pool).
        max_turns: model calls per rollout.
        timeout_s: whole-rollout deadline (seconds).
        harness: ``"inprocess"`` or ``"program"``.
        persistent: take runtimes from a pool (reset between uses).
        pass_env: host variables passed to agent programs and scripts beyond
            the runtime's allow-list (see :class:`lowwater.runtime.RuntimeConfig`).
        sampling: sampling arguments added to every model call forwarded
            upstream (``temperature``, ``top_p``, ``max_tokens``, any other
            key); a key the agent's request sets itself wins (see
            :mod:`lowwater.interception.sampling`).
        runtime: the runtime's registered name (``None``: the environment's
            :attr:`~lowwater.environment.Environment.runtime`, else
            ``"subprocess"``); see :mod:`lowwater.runtime_choice`.
        runtime_options: the runtime's options (JSON values), over the
            environment's ``runtime_options`` key by key.
        program: with ``harness="program"``, a command line (``shlex``
            syntax) run as the agent instead of the environment's own harness
            (:mod:`lowwater.program_harness`); ``None``: the environment's.

    Raises:
        ValueError: a count below 1, a non-positive timeout, an unknown
            harness, a ``program`` without ``harness="program"``.
    """

    env: str = "arithmetic"
    env_options: dict[str, Any] = attrs.field(factory=dict)
    model: ModelSpec = ModelSpec("scripted", "scripted")
    group_size: int = attrs.field(default=1, validator=v.at_least(1, "group-size"))
    concurrency: int = attrs.field(default=32, validator=v.at_least(1))
    max_turns: int = attrs.field(default=16, validator=v.at_least(1, "max-turns"))
    timeout_s: float = attrs.field(default=600.0, validator=v.positive("timeout", "seconds"))
    harness: str = attrs.field(default="inprocess", validator=v.one_of(HARNESSES, "harness"))
    persistent: bool = True
    pass_env: tuple[str, ...] = attrs.field(default=(), converter=v.str_tuple)
    sampling: dict[str, Any] = attrs.field(factory=dict)
    runtime: str | None = None
    runtime_options: dict[str, Any] = attrs.field(factory=dict)
    program: str | None = attrs.field(default=None, validator=v.program_needs_harness)

    def to_json(self) -> dict[str, Any]:
        """The settings a worker process needs, JSON-able."""
        return attrs.asdict(self, recurse=True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineConfig:
        """Inverse of :meth:`to_json`."""
        data = dict(data)
        data["model"] = ModelSpec(**data["model"])
        data["pass_env"] = tuple(data.get("pass_env", ()))
        return cls(**data)


@asynccontextmanager
async def open_engine(
    config: EngineConfig,
    env: Environment,
    plugins: plugins_mod.Plugins,
    upstream_url: str,
    *,
    request_logprobs: bool = False,
) -> AsyncIterator[tuple[Engine, Any]]:
    """An :class:`Engine` for ``env`` with its interception server running.

    Yields ``(engine, server)``; on exit the server is stopped and the
    runtime pool (when ``config.persistent``) closed, shielded.  Used by
    the in-process eval, by each env worker of a pooled one, and by the
    trainer API (with ``request_logprobs``: trainers need token ids and
    logprobs).
    """
    from lowwater.interception import InterceptionServer  # heavy imports, only for runs
    from lowwater.upstream.agent_client import AgentClient
    from lowwater.upstream.client import ModelClient

    pool = None
    try:
        async with ModelClient(upstream_url, api_key=config.model.api_key) as client:
            server = InterceptionServer(
                client, protocols=list(plugins.protocols.values()) or None, request_logprobs=request_logprobs
            )
            server.sampling = dict(config.sampling)
            server.interceptors = plugins.interceptors()
            async with (
                trio.open_nursery() as services,
                AgentClient(max_idle=config.concurrency, timeout_s=config.timeout_s) as http,
            ):
                await services.start(server.run)
                if config.persistent:
                    from lowwater.runtime import RuntimePool

                    # Sized to demand: scoring GSM8K needs one warm math-verify
                    # worker, not one per pooled runtime (benches/eval_gsm8k.py).
                    pool = RuntimePool(plugins.runtimes, max_size=pool_size(config.concurrency), grow="demand")
                engine = Engine(
                    env,
                    server,
                    plugins,
                    http,
                    harness=config.harness,
                    model=config.model.name,
                    max_turns=config.max_turns,
                    deadlines=Deadlines(rollout_s=config.timeout_s),
                    runtime_config=engine_runtime_config(config, env, plugins),
                    pool=pool,
                    program=program_argv(config),
                )
                yield engine, server
                services.cancel_scope.cancel()
    finally:
        if pool is not None:
            with trio.CancelScope(shield=True):
                await pool.aclose()


def pool_size(concurrency: int) -> int:
    """Persistent runtimes a run may hold at once: a few per core, never
    more than the concurrency.

    A program harness holds its runtime for the whole rollout, so beyond
    this many its rollouts wait for a runtime (inside their deadline).  One
    runtime per concurrent rollout was measured on GSM8K (1319 rollouts,
    concurrency 32, two cores): each runtime's warm interpreters (the agent
    program with the ``openai`` SDK, the math-verify scorer) cost 4.1 GB of
    RSS across the process tree and re-paid their imports 32 times, 2.8x
    slower than a pool of four (benches/eval_gsm8k.py, benches/README.md).
    """
    return max(1, min(concurrency, 2 * (os.cpu_count() or 1)))


def engine_runtime_config(config: EngineConfig, env: Environment | None = None, plugins: Any = None) -> Any:
    """The :class:`~lowwater.runtime.RuntimeConfig` of ``config``'s runtime, chosen
    with ``env``'s declared need (:func:`lowwater.runtime_choice.choose_runtime`,
    which validates the name and options when ``plugins`` is given)."""
    try:
        from lowwater.runtime import RuntimeConfig
    except ImportError:  # runtime plugin disabled or absent: in-process only
        return None
    from lowwater.runtime_choice import DEFAULT_RUNTIME, choose_runtime, freeze

    if plugins is not None:
        kind, options = choose_runtime(plugins, config.runtime, config.runtime_options, env)
    else:
        kind = config.runtime or getattr(env, "runtime", None) or DEFAULT_RUNTIME
        options = {**dict(getattr(env, "runtime_options", None) or {}), **config.runtime_options}
    return RuntimeConfig(
        kind=kind,
        persistent=config.persistent,
        pass_env=config.pass_env,
        options={k: freeze(v) for k, v in options.items()},
    )


def program_argv(config: EngineConfig) -> tuple[str, ...] | None:
    from lowwater.program_harness import parse_program

    return None if config.program is None else parse_program(config.program)


class EngineJob(WorkerJob):
    """An env worker's engine, held open for the worker's life; subclasses
    say what one task is (:meth:`run`).

    The environment is built from its name and options, the interception
    server and engine are started against the model server the parent
    started, and tasks arrive by id: the parent keeps ids, never payloads,
    so a task whose worker died is re-run from its id alone.

    Args:
        config: :meth:`EngineConfig.to_json` of the parent's settings.
        upstream_url: the model server's base URL (ends in ``/v1``).
        request_logprobs: ask the upstream for token ids and logprobs.
    """

    def __init__(self, config: dict[str, Any], upstream_url: str, *, request_logprobs: bool = False) -> None:
        self.config = EngineConfig.from_json(config)
        self.upstream_url = upstream_url
        self.request_logprobs = request_logprobs
        self.engine: Engine | None = None
        self.server: Any = None
        self._stop = trio.Event()
        self._closed = trio.Event()
        self._leftovers: dict[str, int] | None = None

    async def setup(self) -> None:
        self.plugins = plugins_mod.load()
        self.env: Environment = self.plugins.environment(self.config.env)(self.config.env_options)
        # The engine's context (a nursery with the interception server) is
        # held open by a service task, not entered here: teardown runs under
        # its own cancel scope, and exiting a nursery there that setup had
        # entered corrupts Trio's scope stack (found on the first pooled run).
        await self.nursery.start(self._hold)

    @asynccontextmanager
    async def resources(self) -> AsyncIterator[None]:
        """Extra resources held with the engine (none here); entered before it."""
        yield

    async def _hold(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with (
                self.resources(),
                open_engine(
                    self.config, self.env, self.plugins, self.upstream_url, request_logprobs=self.request_logprobs
                ) as (engine, server),
            ):
                self.engine, self.server = engine, server
                task_status.started()
                await self._stop.wait()
        finally:
            self._closed.set()

    def leftovers(self) -> dict[str, int]:
        """The engine's and intercept table's non-zero live counts (empty when
        nothing leaked); after ``teardown()``, the counts it measured once the
        ``shutdown`` hooks had run."""
        if self._leftovers is not None:
            return self._leftovers
        if self.engine is None:
            return {}
        state = {**self.engine.stats(), "intercepts": len(self.server.table)}
        return {k: v for k, v in state.items() if v}

    def stats(self) -> dict[str, Any]:
        """Heartbeat extras: the engine's live counts and the intercept table's."""
        if self.engine is None:
            return {}
        return {**self.engine.stats(), "intercepts": len(self.server.table)}

    async def tick(self, stats: dict[str, Any]) -> None:
        if self.engine is None:
            return
        await self.plugins.fire(
            "worker_tick",
            stats={
                **stats,
                "intercepts": self.server.table.stats(),
                "intercept_table": self.server.table,
            },
        )

    async def teardown(self) -> None:
        if self.engine is not None:
            await self.plugins.fire("shutdown")
            leftovers = self._leftovers = self.leftovers()
            if leftovers:  # every per-rollout structure should be empty here
                log.warning("worker ends with per-rollout state left: %s", leftovers)
        self._stop.set()
        await self._closed.wait()
        await self.env.aclose()
