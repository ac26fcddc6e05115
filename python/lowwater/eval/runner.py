"""The eval runner behind ``lowwater eval``: rollouts of an environment against
a model, streamed to a results file, with a memory record and a summary.

Memory discipline (docs/design.md#incidents, the 30-worker evaluation incident):
tasks are pulled from the taskset lazily as concurrency frees up; each
finished rollout's row is written and flushed, then dropped (the runner keeps
running totals, not results); run metadata is one header line.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from lowwater import plugins as plugins_mod
from lowwater.assembly import open_engine
from lowwater.environment import Environment, Task, declared_options
from lowwater.eval.config import EvalConfig
from lowwater.eval.header import build_header
from lowwater.eval.results import SUMMARY_TYPE, ResultsWriter, prepare
from lowwater.eval.samples import SamplesWriter, encode, transcript
from lowwater.eval.summary import SUMMARY_KEYS, EvalReport, Totals
from lowwater.memory import MemoryRecord, Trimmer, rss_bytes
from lowwater.rollout import Engine, Rollout
from lowwater.upstream.spec import model_server

log = logging.getLogger("lowwater.eval")

__all__ = ["SUMMARY_KEYS", "EvalConfig", "EvalReport", "Totals", "run_eval"]


async def _choose_runtime(config: EvalConfig, env: Environment, plugins: plugins_mod.Plugins) -> EvalConfig:
    """``config`` with its runtime chosen (:func:`lowwater.runtime_choice.choose_runtime`)
    and, for ``--program``, the program checked once (:func:`lowwater.program_harness.preflight`)."""
    from lowwater.runtime_choice import choose_runtime

    name, options = choose_runtime(plugins, config.runtime, config.runtime_options, env)
    config = attrs.evolve(config, runtime=name, runtime_options=options)
    if config.program is not None:
        from lowwater.assembly import engine_runtime_config, program_argv
        from lowwater.program_harness import preflight

        runtime_config = engine_runtime_config(config.engine(), env)
        argv = program_argv(config.engine())
        if runtime_config is not None and argv is not None:
            await preflight(plugins, runtime_config, argv, model=config.model.name)
    return config


def check_options(name: str, factory: Any, options: dict[str, Any]) -> None:
    """Refuse option keys the environment's factory does not declare
    (:func:`lowwater.environment.declared_options`); ``seed`` is always
    accepted (every run passes it).  Factories that declare nothing accept anything.

    Raises:
        ValueError: an undeclared key (with the closest declared one, if any).
    """
    declared = declared_options(factory)
    if declared is None:
        return
    for key in options:
        if key == "seed" or key in declared:
            continue
        close = difflib.get_close_matches(key, list(declared), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(declared)) or "none"
        raise ValueError(
            f"environment {name!r} has no option {key!r}{hint} (its options: {known}; see `lowwater envs`)"
        )


def parse_task_id(text: str) -> str | int:
    """A ``--task-ids`` item: an int when it is one (dataset row indices), else the string."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


class TaskFeed:
    """The run's tasks, pulled lazily from the taskset: ``config.task_ids``
    looked up by id, or ``config.rollouts`` of them from position
    ``config.start`` (all when ``None``), minus those already done
    (``--resume``).

    Attributes:
        seen: tasks of the selection examined so far (done ones included).
        exhausted: the taskset ended before ``config.rollouts`` tasks.
    """

    def __init__(self, env: Environment, config: EvalConfig, done: set[Any]) -> None:
        self.env, self.config, self.done = env, config, done
        self.seen = 0
        self.exhausted = False

    def check_ids(self) -> None:
        """Look every ``--task-ids`` id up once, before any model is started.

        Raises:
            ValueError: the taskset has no such task (the message names it).
        """
        for task_id in self.config.task_ids or ():
            try:
                self.env.task(task_id)
            except KeyError as exc:
                message = exc.args[0] if exc.args else task_id
                raise ValueError(f"--task-ids: {message}") from None

    def planned_tasks(self) -> int | None:
        """Tasks this run will start (``None``: the taskset's size is unknown)."""
        config = self.config
        if config.task_ids is not None:
            return sum(1 for t in config.task_ids if t not in self.done)
        size = self.env.task_count()
        count = config.rollouts
        if size is not None:
            available = max(0, size - config.start)
            count = available if count is None else min(count, available)
        if count is None:
            return None
        end = config.start + count
        done = sum(1 for t in self.done if isinstance(t, int) and config.start <= t < end)
        return max(0, count - done)

    def __iter__(self) -> Iterator[Task]:
        if self.config.task_ids is not None:
            for task_id in self.config.task_ids:
                self.seen += 1
                if task_id not in self.done:
                    yield self.env.task(task_id)
            return
        limit, start = self.config.rollouts, self.config.start
        for position, task in enumerate(self.env.tasks()):
            if position < start:
                continue
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
    record: MemoryRecord | None = None,
) -> EvalReport:
    """Run the eval described by ``config``.

    ``on_progress(totals, rss_bytes)`` is called on every tick and after
    every row.  Cancellation (Ctrl-C) cancels in-flight rollouts; their rows
    are still written with error class ``cancelled``.  ``record`` is the
    run's memory record when the caller sampled its baseline earlier
    (``lowwater eval`` does, before anything heavy is imported).

    A run that fails or is cancelled before its first row leaves no file
    behind (a header-only results file said a run existed that never ran);
    on a finished run the summary and memory record are appended as the
    results file's last line (:data:`~lowwater.eval.results.SUMMARY_TYPE`).

    Raises:
        lowwater.plugins.UnknownName: unknown environment.
        lowwater.eval.results.ResultsFileError: ``out`` cannot be (re)used.
        lowwater.upstream.spec.UpstreamError: the model cannot be started/reached.
        ValueError: bad environment options or task ids, an unknown runtime
            option, a ``--runtime`` the environment does not allow.
        lowwater.program_harness.ProgramStartError: the ``--program`` cannot
            start (its imports fail).
    """
    record = record if record is not None else MemoryRecord()
    plugins = plugins or plugins_mod.load()
    factory = plugins.environment(config.env)
    check_options(config.env, factory, config.env_options)
    from lowwater.http.exposure import reachable_config  # lazy: the HTTP stack only for runs

    config = reachable_config(
        config, plugins
    )  # an unknown --backend or an unreachable model fails before anything starts
    env: Environment = factory(config.env_options)
    run_id = uuid.uuid4().hex[:12]
    try:
        # Resolved here, once: the header records the runtime the rows ran
        # in, and workers get the name, never a choice of their own.
        config = await _choose_runtime(config, env, plugins)
        header = build_header(config, run_id)
        state = prepare(
            config.out, header, resume=config.resume, group_size=config.group_size, max_attempts=config.max_attempts
        )
    except BaseException:
        with trio.CancelScope(shield=True):
            await env.aclose()
        raise
    totals = Totals(config.group_size)
    for row in state.kept_rows:
        totals.add(row, this_run=False)
    state.kept_rows.clear()  # counted; not kept
    started = time.perf_counter()
    writer = ResultsWriter(config.out)
    samples = SamplesWriter(config.samples_path, run_id, config.out.name) if config.samples_path else None
    feed = TaskFeed(env, config, state.done)

    async def write(row: dict[str, Any], attempt: int = 1, sample: bytes | None = None) -> None:
        row["run_id"] = run_id
        row["attempts"] = state.attempts.get(row.get("task_id"), 0) + attempt
        if sample is not None and samples is not None:
            # The transcript goes first: a row in the results file always has its transcript.
            await samples.write(sample)
        await writer.write(row)
        totals.add(row, this_run=True)
        if on_progress is not None:
            on_progress(totals, record.last_bytes)

    pool_report = None
    finished = False
    try:
        feed.check_ids()
        planned = feed.planned_tasks()
        totals.planned = None if planned is None else planned * config.group_size
        async with model_server(config.model, host=config.bind, advertise=config.advertise) as upstream_url:
            run = _Run(
                config, env, plugins, upstream_url, feed, record, totals, write, on_progress, samples is not None
            )
            if config.workers:
                pool_report = await _run_pooled(run)
                # What the workers reported as they exited (summed over workers).
                leftovers = dict(pool_report.get("leftovers") or {})
            else:
                leftovers = await _run_here(run)
        finished = True
    finally:
        writer.close()
        if samples is not None:
            samples.close()
        if not finished and state.fresh and writer.rows_written == 0:
            # Nothing ran: a header-only file would claim a run that never happened.
            with contextlib.suppress(OSError):
                config.out.unlink()
        with trio.CancelScope(shield=True):
            await env.aclose()
    record.add(finished=totals.this_run, keep=True)  # the end of the work, before the drain
    wall_s = time.perf_counter() - started
    # Resting RSS: after the run's structures are gone and the allocator trimmed.
    await trio.to_thread.run_sync(Trimmer(0.0))
    resting = record.add(finished=totals.this_run, keep=True)
    # Per-rollout state still alive after the run (non-zero counts only): a
    # leak in this process or in any env worker shows up here, not only in a log.
    summary = totals.summary(wall_s, record.summary(resting), {k: v for k, v in leftovers.items() if v})
    await _append_summary(config.out, run_id, summary, record)
    available = feed.seen if feed.exhausted else None
    return EvalReport(summary, dict(totals.errors), record, config.out, leftovers, pool_report, available, run_id)


async def _append_summary(path: Path, run_id: str, summary: dict[str, Any], record: MemoryRecord) -> None:
    """The finished run's summary and memory record, as the results file's last line
    (what ``lowwater view`` plots); a resume drops it and appends its own."""
    line = {"type": SUMMARY_TYPE, "run_id": run_id, "summary": summary, "memory": record.to_json()}
    with ResultsWriter(path) as writer:
        await writer.write(line)


@attrs.define
class _Run:
    """What running the tasks needs, here or in workers: the settings and
    model, the tasks, and where rows, samples and memory samples go."""

    config: EvalConfig
    env: Environment
    plugins: plugins_mod.Plugins
    upstream_url: str
    tasks: TaskFeed
    record: MemoryRecord
    totals: Totals
    write: Callable[..., Awaitable[None]]
    on_progress: Callable[[Totals, int], None] | None
    with_samples: bool

    async def sample_memory(self) -> None:
        """RSS samples on the record's adaptive interval (often early, rarer as the run grows)."""
        while True:
            await trio.sleep(self.record.interval_s())
            self.record.add(rss_bytes(), self.totals.this_run)
            if self.on_progress is not None:
                self.on_progress(self.totals, self.record.last_bytes)


async def _run_here(run: _Run) -> dict[str, int]:
    """Every rollout in this process; returns the engine's final stats."""
    config, plugins = run.config, run.plugins
    async with open_engine(config.engine(), run.env, plugins, run.upstream_url) as (engine, server):

        async def on_result(rollout: Rollout) -> None:
            # Runs before the engine evicts the trajectory: the transcript is
            # encoded from it here and the bytes dropped once written.
            sample = encode(transcript(rollout)) if run.with_samples else None
            await run.write(rollout.result(), sample=sample)

        async def tick() -> None:
            while True:
                await trio.sleep(config.tick_s)
                stats = {
                    "rss_bytes": rss_bytes(),
                    "in_flight": engine.in_flight,
                    "finished": run.totals.this_run,
                    "intercepts": server.table.stats(),
                    "intercept_table": server.table,
                    "memory_record": run.record,
                }
                await plugins.fire("worker_tick", stats=stats)

        async with trio.open_nursery() as ticker:
            ticker.start_soon(tick)
            ticker.start_soon(run.sample_memory)
            await _run_tasks(engine, run.tasks, config, on_result)
            await plugins.fire("shutdown")
            ticker.cancel_scope.cancel()
        return {**engine.stats(), "intercepts": len(server.table)}


async def _run_pooled(run: _Run) -> dict[str, Any]:
    """Every task in ``config.workers`` env worker processes (per node, on a
    multi-node backend) of ``config.backend``; returns the pool's report.
    The parent keeps task ids only; a task whose worker (or node pool)
    died is re-run from its id and its rows say how many attempts it took.
    The memory record samples this (parent) process, so baseline, peak and
    resting compare like with like; workers' RSS is in the pool report
    (``worker_rss_peak_mb``, ``pool_rss_peak_mb``)."""
    from lowwater.workers import JobSpec, PoolConfig
    from lowwater.workers.backend import BackendOptions, open_backend

    config = run.config
    backend = open_backend(run.plugins, config.backend, BackendOptions(config.address))
    per_worker = max(1, -(-config.concurrency // (config.group_size * config.workers)))
    spec = JobSpec(
        "lowwater.eval.job:make_job",
        {"config": config.engine().to_json(), "upstream_url": run.upstream_url, "samples": run.with_samples},
    )
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
            sample = row.pop("sample", None)
            if info.retried:
                row["retried"] = True
            await run.write(row, info.attempt, None if sample is None else encode(sample))

    async with trio.open_nursery() as ticker:
        ticker.start_soon(run.sample_memory)
        report = await pool.run((task.id for task in run.tasks), on_rows)
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
