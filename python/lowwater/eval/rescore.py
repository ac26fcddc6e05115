"""``lowwater score RUN.jsonl``: re-score a finished run's transcripts with
the environment's current rubric, without calling the model.

Each transcript (``RUN.samples.jsonl``) holds what the rubric reads: the
task, the environment's state left by the harness (the final answer) and
the turns.  A :class:`~lowwater.rollout.Rollout` is rebuilt from it, with
its trajectory, and scored by ``Environment.score`` (and
``Environment.group_reward`` for groups) on runtimes from a pool, as in the
run.  Rows without a transcript, and rollouts that ended in an error, are
copied unchanged.  The rescored file is a results file of its own: a header
naming the run it came from, one row per rollout, a summary line.

Memory: the run's rows (small) are read once; transcripts are read one
group at a time from their offsets, scored and dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson
import trio

from lowwater import plugins as plugins_mod
from lowwater.environment import Environment, Task
from lowwater.eval.results import SUMMARY_TYPE, ResultsFileError, ResultsWriter, read_rows, read_summary
from lowwater.eval.samples import index, read_sample
from lowwater.memory import MemoryRecord
from lowwater.rollout import Group, Rollout, RolloutError, classify
from lowwater.trajectory import Trajectory, TrajectoryRegistry, turns_from_json


@attrs.define
class RescoreReport:
    """What :func:`rescore` did.

    Attributes:
        out: the rescored results file.
        rescored: rollouts scored again.
        changed: of those, rollouts whose reward or ``metrics.correct`` changed.
        copied: rows copied unchanged (no transcript, or an errored rollout).
        summary: the rescored file's summary (the ``--summary-json`` keys).
        before: the original run's summary (``None`` if it has none).
    """

    out: Path
    rescored: int
    changed: int
    copied: int
    summary: dict[str, Any]
    before: dict[str, Any] | None


def default_out(results: Path) -> Path:
    """``runs/x.jsonl`` -> ``runs/x.rescored.jsonl``."""
    return results.with_name(results.name.removesuffix(".jsonl") + ".rescored.jsonl")


def _rollout(sample: dict[str, Any], task: Task) -> Rollout:
    rollout = Rollout(
        str(sample["rollout_id"]),
        task,
        sample.get("group_id"),
        attempt=int(sample.get("attempt") or 1),
        state=dict(sample.get("state") or {}),
    )
    trajectory = Trajectory(rollout.rollout_id, task.id, rollout.group_id)
    # The file writes a rollout's tools once per change: each turn gets its own back.
    for turn in turns_from_json(sample.get("turns") or ()):
        trajectory.add_turn(turn)
    rollout.trajectory = trajectory
    rollout.turn_count = len(trajectory.turns)
    return rollout


def _task(sample: dict[str, Any]) -> Task:
    stored = sample.get("task") or {}
    return Task(
        sample["task_id"], str(stored.get("prompt", "")), str(stored.get("answer", "")), stored.get("metadata") or {}
    )


def _units(rows: list[dict[str, Any]]) -> Iterator[list[int]]:
    """Row indices to score together: each group's members, or one rollout."""
    groups: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        gid = row.get("group_id")
        if gid is None:
            yield [i]
        else:
            groups.setdefault(gid, []).append(i)
    yield from groups.values()


async def rescore(
    results: Path,
    out: Path | None = None,
    *,
    env_options: dict[str, Any] | None = None,
    concurrency: int = 8,
    plugins: plugins_mod.Plugins | None = None,
) -> RescoreReport:
    """Re-score ``results`` from its transcripts into ``out`` (see the module doc).

    Args:
        results: a finished (or partial) results file with a samples file beside it.
        out: where to write (default :func:`default_out`); must not exist.
        env_options: override or add environment options (a moved ``data`` file).
        concurrency: rollouts scored at once.

    Raises:
        ResultsFileError: ``results`` is not a results file, has no samples
            file, or ``out`` exists.
        lowwater.plugins.UnknownName: the run's environment is not installed.
    """
    from lowwater.assembly import pool_size
    from lowwater.eval.runner import Totals
    from lowwater.runtime import RuntimeConfig, RuntimePool

    out = out or default_out(results)
    if out.exists():
        raise ResultsFileError(f"{out} exists; choose another --out")
    header, rows, _ = read_rows(results)
    if header is None:
        raise ResultsFileError(f"{results} has no lowwater header line; not a results file")
    if not header.get("samples"):
        raise ResultsFileError(f"{results} was run with --no-samples: there are no transcripts to re-score")
    samples = results.with_name(header["samples"])
    if not samples.is_file():
        raise ResultsFileError(f"{results}: its samples file {samples} is missing")
    where = index(samples)
    plugins = plugins or plugins_mod.load()
    options = {**header.get("env_options", {}), **(env_options or {})}
    env: Environment = plugins.environment(header["env"])(options)
    record = MemoryRecord()
    started = time.perf_counter()
    totals = Totals(int(header.get("group_size") or 1))
    counts = {"rescored": 0, "changed": 0, "copied": 0}
    runtime = header.get("runtime") or {}
    config = RuntimeConfig(kind="subprocess", persistent=True, pass_env=tuple(runtime.get("pass_env") or ()))
    pool = RuntimePool(plugins.runtimes, max_size=pool_size(concurrency), grow="demand")
    new_header = {**header, "run_id": f"{header.get('run_id')}-rescored", "rescored_from": header.get("run_id")}
    new_header["rescored"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new_header["samples"] = None  # the transcripts stay the original run's
    out.parent.mkdir(parents=True, exist_ok=True)
    limiter = trio.CapacityLimiter(concurrency)

    async def score_unit(members: list[int], writer: ResultsWriter) -> None:
        async with limiter:
            rollouts: list[tuple[int, Rollout]] = []
            for i in members:
                row = rows[i]
                loc = where.get(str(row.get("rollout_id")))
                if loc is None or row.get("error") is not None:
                    continue
                sample = orjson.loads(read_sample(samples, loc))
                rollouts.append((i, _rollout(sample, _task(sample))))
            for _, member in rollouts:
                await _score(env, member, pool, config)
            if len(rollouts) > 1:
                await _group_reward(env, [r for _, r in rollouts])
            scored = dict(rollouts)
            for i in members:
                row = rows[i]
                rollout = scored.get(i)
                if rollout is None:
                    counts["copied"] += 1
                else:
                    counts["rescored"] += 1
                    old = (row.get("reward"), (row.get("metrics") or {}).get("correct"))
                    row = {
                        **row,
                        "reward": rollout.reward,
                        "metrics": rollout.metrics,
                        "error": None if rollout.error is None else rollout.error.to_json(),
                        "previous": {"reward": row.get("reward"), "metrics": row.get("metrics")},
                    }
                    counts["changed"] += old != (rollout.reward, rollout.metrics.get("correct"))
                await writer.write(row)
                totals.add(row, this_run=True)

    try:
        _write_header(out, new_header)
        with ResultsWriter(out) as writer:
            async with trio.open_nursery() as nursery:
                for unit in _units(rows):
                    nursery.start_soon(score_unit, unit, writer)
    finally:
        with trio.CancelScope(shield=True):
            await pool.aclose()
            await env.aclose()
    summary = totals.summary(time.perf_counter() - started, record.summary(record.add(keep=True)))
    with ResultsWriter(out) as writer:
        await writer.write({"type": SUMMARY_TYPE, "run_id": new_header["run_id"], "summary": summary})
    before = read_summary(results)
    return RescoreReport(
        out, counts["rescored"], counts["changed"], counts["copied"], summary, before and before.get("summary")
    )


def _write_header(path: Path, header: dict[str, Any]) -> None:
    from lowwater.jsonl import write_atomic

    write_atomic(path, [orjson.dumps(header, option=orjson.OPT_NON_STR_KEYS) + b"\n"])


async def _score(env: Environment, rollout: Rollout, pool: Any, config: Any) -> None:
    """``env.score`` on a rebuilt rollout, with a pooled runtime if it asks for one."""
    held: list[Any] = []

    async def runtime() -> Any:
        if not held:
            held.append(await pool.acquire(config))
        return held[0]

    rollout._runtime_getter = runtime
    try:
        score = await env.score(rollout)
        rollout.reward, rollout.metrics = float(score.reward), dict(score.metrics)
    except Exception as exc:
        rollout.error = classify(exc)
    finally:
        if held:
            with trio.CancelScope(shield=True):
                await pool.release(held[0])


async def _group_reward(env: Environment, members: list[Rollout]) -> None:
    registry = TrajectoryRegistry()
    group_id = str(members[0].group_id)
    for rollout in members:
        live = registry.open(rollout.rollout_id, task_id=rollout.task.id, group_id=group_id)
        live.turns.extend(rollout.trajectory.turns if rollout.trajectory else [])
    try:
        rewards = await env.group_reward(Group(group_id, members[0].task, members, registry))
    except Exception as exc:
        error = classify(exc)
        for rollout in members:
            if rollout.error is None:
                rollout.error = RolloutError(error.cls, f"group reward: {error.message}")
        return
    finally:
        registry.close_group(group_id)
    if rewards is not None and len(rewards) == len(members):
        for rollout, reward in zip(members, rewards, strict=True):
            if rollout.error is None:
                rollout.reward = float(reward)
