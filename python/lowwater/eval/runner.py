"""The eval runner behind ``lowwater eval``: rollouts of an environment against
a model, streamed to a results file, with a memory record and a summary.

Memory discipline (docs/design.md#incidents, the 30-worker evaluation incident):
tasks are pulled from the taskset lazily as concurrency frees up; each
finished rollout's row is written and flushed, then dropped (the runner keeps
running totals, not results); run metadata is one header line.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from lowwater import _validate as v
from lowwater import plugins as plugins_mod
from lowwater.assembly import EngineConfig, open_engine
from lowwater.environment import HARNESSES, Environment, Task
from lowwater.eval.results import ResultsWriter, prepare
from lowwater.memory import MemoryRecord, Trimmer, rss_bytes
from lowwater.rollout import ERROR_CLASSES, Engine, Rollout
from lowwater.upstream.spec import ModelSpec, model_server

log = logging.getLogger("lowwater.eval")

#: The keys of ``--summary-json``, in order.
SUMMARY_KEYS = (
    "rollouts",
    "completed",
    "errors",
    "accuracy",
    "reward_mean",
    "turns_mean",
    "wall_s",
    "rollouts_per_s",
    "rss_baseline_mb",
    "rss_peak_mb",
    "rss_resting_mb",
)


@attrs.frozen
class EvalConfig:
    """Everything ``lowwater eval`` takes; the CLI flags map one to one.

    Attributes:
        env: environment name (``register_environments``).
        env_options: options for the environment's factory (``--data`` ...).
        model: the resolved ``--model``.
        rollouts: tasks to run from the start of the taskset (``None``: all).
        group_size: rollouts per task (a group when > 1).
        concurrency: rollouts in flight at once.
        max_turns: model calls per rollout.
        timeout_s: whole-rollout deadline (seconds).
        harness: ``"inprocess"`` or ``"program"``.
        persistent: take runtimes from a pool (reset between uses).
        out: the JSONL results file.
        resume: continue ``out`` instead of refusing to touch it.
        max_attempts: eval runs that may attempt an errored task (``--resume``).
        seed: recorded in the header; environments take it from ``env_options``.
        tick_s: worker-tick cadence (seconds): RSS samples, stale sweeps.
        workers: env worker processes (``--workers``); 0 runs every rollout
            in this process.  With workers, each runs its own interception
            server and engine (see :mod:`lowwater.eval.job`) and the model
            server is shared.
        max_tasks_per_worker, max_rss_mb, high_water_mb: recycling and
            admission settings of the worker pool (see
            :class:`lowwater.workers.WorkerPool`).
        backend: the worker backend the workers run on (``--backend``;
            ``register_backends``): ``"local"`` (this machine) or a
            plugin's (``"ray"``: ``workers`` per node).
        address: the cluster the backend joins (``--address``; ``ray``:
            ``auto`` or ``HOST:PORT``).
        pass_env: host variables passed to agent programs and scripts beyond
            the runtime's allow-list (``--pass-env``).

    Raises:
        ValueError: a setting out of range (the message names its flag).
    """

    env: str = "arithmetic"
    env_options: dict[str, Any] = attrs.field(factory=dict)
    model: ModelSpec = ModelSpec("scripted", "scripted")
    rollouts: int | None = attrs.field(default=None, validator=v.optional(v.at_least(0, "rollouts")))
    group_size: int = attrs.field(default=1, validator=v.at_least(1, "group-size"))
    concurrency: int = attrs.field(default=32, validator=v.at_least(1))
    max_turns: int = attrs.field(default=16, validator=v.at_least(1, "max-turns"))
    timeout_s: float = attrs.field(default=600.0, validator=v.positive("timeout", "seconds"))
    harness: str = attrs.field(default="inprocess", validator=v.one_of(HARNESSES, "harness"))
    persistent: bool = True
    out: Path = Path("runs/results.jsonl")
    resume: bool = False
    max_attempts: int = attrs.field(default=3, validator=v.at_least(1, "max-attempts"))
    seed: int = 0
    tick_s: float = attrs.field(default=1.0, validator=v.positive("tick", "seconds"))
    workers: int = attrs.field(default=0, validator=v.at_least(0))
    backend: str = attrs.field(default="local")
    address: str | None = None
    max_tasks_per_worker: int | None = attrs.field(
        default=500, validator=v.optional(v.at_least(1, "max-tasks-per-worker"))
    )
    max_rss_mb: float | None = attrs.field(default=None, validator=v.optional(v.positive("max-rss-mb")))
    high_water_mb: float | None = attrs.field(default=None, validator=v.optional(v.positive("high-water-mb")))
    pass_env: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @backend.validator
    def _check_backend(self, _attribute: Any, value: str) -> None:
        if value != "local" and self.workers < 1:
            raise ValueError(f"--backend {value} runs env workers: give --workers K (worker processes per node)")

    def engine(self) -> EngineConfig:
        """The settings that define this run's engines (here or in each worker)."""
        return EngineConfig(
            env=self.env,
            env_options=self.env_options,
            model=self.model,
            group_size=self.group_size,
            concurrency=self.concurrency,
            max_turns=self.max_turns,
            timeout_s=self.timeout_s,
            harness=self.harness,
            persistent=self.persistent,
            pass_env=self.pass_env,
        )


class Totals:
    """Running totals for the summary (no result is kept)."""

    def __init__(self) -> None:
        self.rollouts = 0
        self.completed = 0
        self.correct = 0
        self.reward_sum = 0.0
        self.turns_sum = 0
        self.errors: Counter[str] = Counter()
        self.this_run = 0

    def add(self, row: dict[str, Any], *, this_run: bool) -> None:
        self.rollouts += 1
        self.this_run += this_run
        self.turns_sum += int(row.get("turns") or 0)
        error = row.get("error")
        if error:
            self.errors[error.get("class", "infra")] += 1
            return
        self.completed += 1
        self.reward_sum += float(row.get("reward") or 0.0)
        self.correct += bool((row.get("metrics") or {}).get("correct"))

    def summary(self, wall_s: float, memory: dict[str, float]) -> dict[str, Any]:
        """The ``--summary-json`` figures (see :data:`SUMMARY_KEYS`).

        ``accuracy`` is correct rollouts over all rollouts (an errored
        rollout counts as wrong); ``reward_mean`` is over completed ones;
        ``rollouts_per_s`` counts this run's rollouts only.
        """
        n = self.rollouts
        return {
            "rollouts": n,
            "completed": self.completed,
            "errors": sum(self.errors.values()),
            "accuracy": self.correct / n if n else 0.0,
            "reward_mean": self.reward_sum / self.completed if self.completed else 0.0,
            "turns_mean": self.turns_sum / n if n else 0.0,
            "wall_s": round(wall_s, 3),
            "rollouts_per_s": round(self.this_run / wall_s, 3) if wall_s > 0 else 0.0,
            **memory,
        }


@attrs.define
class EvalReport:
    """What :func:`run_eval` returns: the summary, errors by class, the
    memory record, the results path and the engine's final stats (all zero
    when nothing leaked).

    ``tasks_available`` is set when ``-n`` asked for more tasks than the
    taskset has: the number it has (all of which ran).
    """

    summary: dict[str, Any]
    errors_by_class: dict[str, int]
    memory: MemoryRecord
    out: Path
    leftovers: dict[str, int]
    pool: dict[str, Any] | None = None
    tasks_available: int | None = None


class TaskFeed:
    """The run's tasks, pulled lazily from the taskset: the first
    ``config.rollouts`` of them (all when ``None``), minus those already
    done (``--resume``).

    Attributes:
        seen: taskset tasks examined so far (done ones included).
        exhausted: the taskset ended before ``config.rollouts`` tasks.
    """

    def __init__(self, env: Environment, config: EvalConfig, done: set[Any]) -> None:
        self.env, self.config, self.done = env, config, done
        self.seen = 0
        self.exhausted = False

    def __iter__(self) -> Iterator[Task]:
        limit = self.config.rollouts
        for task in self.env.tasks():
            if limit is not None and self.seen >= limit:
                return
            self.seen += 1
            if task.id not in self.done:
                yield task
        self.exhausted = limit is not None and self.seen < limit


async def run_eval(
    config: EvalConfig,
    *,
    plugins: plugins_mod.Plugins | None = None,
    on_progress: Callable[[Totals, int], None] | None = None,
) -> EvalReport:
    """Run the eval described by ``config``.

    ``on_progress(totals, rss_bytes)`` is called on every tick and after
    every row.  Cancellation (Ctrl-C) cancels in-flight rollouts; their rows
    are still written with error class ``cancelled``.

    Raises:
        lowwater.plugins.UnknownName: unknown environment.
        lowwater.eval.results.ResultsFileError: ``out`` cannot be (re)used.
        lowwater.upstream.spec.UpstreamError: the model cannot be started/reached.
        ValueError: bad environment options.
    """
    plugins = plugins or plugins_mod.load()
    env: Environment = plugins.environment(config.env)(config.env_options)
    if config.workers:
        plugins.backend(config.backend)  # an unknown --backend fails before anything starts
    run_id = uuid.uuid4().hex[:12]
    header = {
        "type": "lowwater.eval.header",
        "run_id": run_id,
        "env": config.env,
        "env_options": {k: str(v) for k, v in config.env_options.items()},
        "model": config.model.name,
        "harness": config.harness,
        "group_size": config.group_size,
        "max_turns": config.max_turns,
        "seed": config.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    state = prepare(
        config.out, header, resume=config.resume, group_size=config.group_size, max_attempts=config.max_attempts
    )
    totals = Totals()
    for row in state.kept_rows:
        totals.add(row, this_run=False)
    state.kept_rows.clear()  # counted; not kept
    record = MemoryRecord()
    started = time.perf_counter()
    writer = ResultsWriter(config.out)
    feed = TaskFeed(env, config, state.done)

    async def write(row: dict[str, Any], attempt: int = 1) -> None:
        row["run_id"] = run_id
        row["attempts"] = state.attempts.get(row.get("task_id"), 0) + attempt
        await writer.write(row)
        totals.add(row, this_run=True)
        if on_progress is not None:
            on_progress(totals, record.last_bytes)

    pool_report = None
    try:
        async with model_server(config.model) as upstream_url:
            if config.workers:
                pool_report = await _run_pooled(
                    config, env, upstream_url, feed, record, totals, write, on_progress, plugins=plugins
                )
                leftovers = {}
            else:
                leftovers = await _run_here(
                    config, env, plugins, upstream_url, feed, record, totals, write, on_progress
                )
    finally:
        writer.close()
        with trio.CancelScope(shield=True):
            await env.aclose()
    wall_s = time.perf_counter() - started
    # Resting RSS: after the run's structures are gone and the allocator trimmed.
    await trio.to_thread.run_sync(Trimmer(0.0))
    resting = record.add(finished=totals.this_run)
    summary = totals.summary(wall_s, record.summary(resting))
    available = feed.seen if feed.exhausted else None
    return EvalReport(summary, dict(totals.errors), record, config.out, leftovers, pool_report, available)


async def _run_here(
    config: EvalConfig,
    env: Environment,
    plugins: plugins_mod.Plugins,
    upstream_url: str,
    tasks: TaskFeed,
    record: MemoryRecord,
    totals: Totals,
    write: Any,
    on_progress: Any,
) -> dict[str, int]:
    """Every rollout in this process; returns the engine's final stats."""
    async with open_engine(config.engine(), env, plugins, upstream_url) as (engine, server):

        async def on_result(rollout: Rollout) -> None:
            await write(rollout.result())

        async def tick() -> None:
            while True:
                await trio.sleep(config.tick_s)
                rss = rss_bytes()
                stats = {
                    "rss_bytes": rss,
                    "in_flight": engine.in_flight,
                    "finished": totals.this_run,
                    "intercepts": server.table.stats(),
                    "intercept_table": server.table,
                    "memory_record": record,
                }
                await plugins.fire("worker_tick", stats=stats)
                if "rss-sampling" not in plugins.cleanup_policies:
                    record.add(rss, totals.this_run)
                if on_progress is not None:
                    on_progress(totals, record.last_bytes)

        async with trio.open_nursery() as ticker:
            ticker.start_soon(tick)
            await _run_tasks(engine, tasks, config, on_result)
            await plugins.fire("shutdown")
            ticker.cancel_scope.cancel()
        return {**engine.stats(), "intercepts": len(server.table)}


async def _run_pooled(
    config: EvalConfig,
    env: Environment,
    upstream_url: str,
    tasks: TaskFeed,
    record: MemoryRecord,
    totals: Totals,
    write: Any,
    on_progress: Any,
    *,
    plugins: plugins_mod.Plugins,
) -> dict[str, Any]:
    """Every task in ``config.workers`` env worker processes (per node, on a
    multi-node backend) of ``config.backend``; returns the pool's report.
    The parent keeps task ids only; a task whose worker (or node pool)
    died is re-run from its id and its rows say how many attempts it took.
    The memory record samples this (parent) process, so baseline, peak and
    resting compare like with like; workers' RSS is in the pool report
    (``worker_rss_peak_mb``, ``pool_rss_peak_mb``)."""
    from lowwater.workers import JobSpec, PoolConfig
    from lowwater.workers.backend import BackendOptions, open_backend

    backend = open_backend(plugins, config.backend, BackendOptions(config.address))
    per_worker = max(1, -(-config.concurrency // (config.group_size * config.workers)))
    spec = JobSpec("lowwater.eval.job:make_job", {"config": config.engine().to_json(), "upstream_url": upstream_url})
    pool_config = PoolConfig(
        workers=config.workers,
        concurrency_per_worker=per_worker,
        max_tasks_per_worker=config.max_tasks_per_worker,
        max_rss_mb=config.max_rss_mb,
        high_water_mb=config.high_water_mb,
        heartbeat_s=config.tick_s,
        seed=config.seed,
        preload=("lowwater.eval.job",),
    )
    pool = backend.pool(spec, pool_config)

    async def on_rows(rows: list[dict[str, Any]], info: Any) -> None:
        if len(rows) == 1 and "rollout_id" not in rows[0]:
            # Synthesized by the pool or the worker (the job raised, or its
            # worker kept dying): give it a row's shape, one per group member,
            # so --resume counts the task like any other.
            error = rows[0].get("error")
            rows = [
                {
                    "task_id": info.task_id,
                    "rollout_id": None,
                    "group_id": None,
                    "reward": None,
                    "metrics": {},
                    "turns": 0,
                    "error": error,
                    "timing": {},
                }
                for _ in range(config.group_size)
            ]
        for row in rows:
            if info.retried:
                row["retried"] = True
            await write(row, info.attempt)

    async def tick() -> None:
        while True:
            await trio.sleep(config.tick_s)
            record.add(rss_bytes(), totals.this_run)
            if on_progress is not None:
                on_progress(totals, record.last_bytes)

    async with trio.open_nursery() as ticker:
        ticker.start_soon(tick)
        report = await pool.run((task.id for task in tasks), on_rows)
        ticker.cancel_scope.cancel()
    return report.to_json()


async def _run_tasks(engine: Engine, tasks: TaskFeed, config: EvalConfig, on_result: Any) -> None:
    """Pull tasks lazily and keep ``concurrency`` rollouts in flight."""
    # A group of g rollouts takes g slots of the concurrency budget.
    limiter = trio.CapacityLimiter(max(config.concurrency, config.group_size))
    async with trio.open_nursery() as nursery:
        for task in tasks:
            tokens = [object() for _ in range(config.group_size)]
            for token in tokens:
                await limiter.acquire_on_behalf_of(token)
            nursery.start_soon(_one, engine, task, config.group_size, on_result, limiter, tokens)


async def _one(
    engine: Engine, task: Task, group_size: int, on_result: Any, limiter: trio.CapacityLimiter, tokens: list[object]
) -> None:
    try:
        if group_size == 1:
            await engine.run_rollout(task, on_result=on_result)
        else:
            await engine.run_group(task, group_size, on_result=on_result)
    finally:
        for token in tokens:
            limiter.release_on_behalf_of(token)


ERROR_ORDER = ERROR_CLASSES
