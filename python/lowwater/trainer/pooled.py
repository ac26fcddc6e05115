"""The trainer's env workers: one pool of the configured backend for the whole
life of a :class:`~lowwater.trainer.Lowwater`, fed each step's groups.

Why a pool that outlives the step: a pool per batch paid a worker start per
step (a forkserver fork and the job's setup; on Ray a new actor takes 1.35 s
to answer).  Kept across steps, a worker due to retire still must not take
a step's data with it before the trainer has consumed it, so the pool pins
every worker to the steps whose groups it ran
(:class:`~lowwater.workers.WorkerPool` ``pin_by``) and the trainer's
``clear_batch`` releases the step (:meth:`GroupPool.release`).

Task ids are ``"s{step}|{index}|{json task id}"``: unique in the pool (a
task may come twice in one batch), and the worker gets the step and the
environment's id back from them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
import trio

from lowwater.environment import Task
from lowwater.trainer.shards import ShardRef, ShardStore

log = logging.getLogger("lowwater.trainer")

#: One group's result: ``(task_id, refs, rewards, errors)``, or ``None``.
Slot = tuple[Any, list[ShardRef], tuple[float, ...], int] | None


def task_key(step: int, index: int, task: Task) -> str:
    """The pool's id of group ``index`` of ``step``."""
    return f"s{step}|{index}|{orjson.dumps(task.id).decode()}"


def step_of(task_id: Any) -> str | None:
    """The pin key of a task id: ``"s{step}"`` (``None`` for an id of another form)."""
    head, sep, _ = str(task_id).partition("|")
    return head if sep and head.startswith("s") else None


class _StepRows:
    """The rows of one step as they arrive: a slot per group."""

    def __init__(self, n: int) -> None:
        self.slots: list[Slot] = [None] * n
        self.missing = n
        self.done = trio.Event()
        self.summary = {"tasks": 0, "failed_tasks": 0, "retried_tasks": 0}


class GroupPool:
    """Runs groups in env workers of ``config.backend`` for a trainer.

    Args:
        config: the :class:`~lowwater.trainer.TrainerConfig`.
        plugins: the loaded plugins (the backend is looked up there).
        upstream_url: the model server's base URL (ends in ``/v1``).
        store: this process's shard store (workers of the local backend
            upload to it; shards of abandoned steps are removed from it).

    Raises:
        lowwater.plugins.UnknownName: unknown backend.
    """

    def __init__(self, config: Any, plugins: Any, upstream_url: str, store: ShardStore) -> None:
        from lowwater.workers import JobSpec, PoolConfig
        from lowwater.workers.backend import NODE_STORE_URL, BackendOptions, open_backend
        from lowwater.workers.stream import TaskStream

        self.config = config
        self.store = store
        self.backend = open_backend(plugins, config.backend, BackendOptions(config.ray_address))
        store_url = NODE_STORE_URL if self.backend.node_stores else f"http://{store.address}"
        spec = JobSpec(
            "lowwater.trainer.job:make_job",
            {
                "config": config.engine().to_json(),
                "upstream_url": upstream_url,
                "store_url": store_url,
                "step": 0,
                "request_logprobs": config.request_logprobs,
            },
        )
        pool_config = PoolConfig(
            workers=config.workers,
            concurrency_per_worker=max(1, -(-config.concurrency // config.workers)),
            max_tasks_per_worker=config.max_tasks_per_worker,
            max_rss_mb=config.max_rss_mb,
            preload=("lowwater.trainer.job",),
        )
        self.pool = self.backend.pool(spec, pool_config, pin_by=step_of)
        self.stream = TaskStream()
        self.report: dict[str, Any] | None = None
        self._steps: dict[int, _StepRows] = {}
        self._failure: BaseException | None = None
        self._stopped = trio.Event()

    async def run(self) -> None:
        """The pool's life (a task of the trainer's nursery) until :meth:`aclose`.

        A pool failure (workers that cannot start) is kept and raised by the
        waiting and the next :meth:`run_groups`, not here: the trainer's
        services must not be torn down by it.
        """
        try:
            report = await self.pool.run(self.stream, self._on_rows)
            self.report = report.to_json()
        except Exception as exc:
            self._failure = exc
            log.error("the trainer's worker pool failed: %r", exc)
        finally:
            self._stopped.set()
            for rows in self._steps.values():
                rows.done.set()

    async def run_groups(self, step: int, tasks: Sequence[Task]) -> tuple[list[Slot], dict[str, Any]]:
        """Run one step's groups; their slots in order and the step's counts
        (``tasks``, ``failed_tasks``, ``retried_tasks``).

        Raises:
            lowwater.workers.WorkerStartError: workers keep failing to start.
            RuntimeError: the pool stopped.
        """
        self._check()
        rows = _StepRows(len(tasks))
        self._steps[step] = rows
        try:
            self.stream.submit(task_key(step, i, task) for i, task in enumerate(tasks))
            await rows.done.wait()
        finally:
            del self._steps[step]
        if rows.missing:
            self._check()
            raise RuntimeError(f"the trainer's worker pool stopped with {rows.missing} group(s) of step {step} unrun")
        return rows.slots, {"step": step, **rows.summary}

    def release(self, step: int) -> None:
        """Step ``step`` was cleared: its workers may retire."""
        self.pool.unpin(f"s{step}")

    def stats(self) -> dict[str, Any]:
        return self.pool.stats()

    async def aclose(self) -> None:
        """No more groups: let the pool finish and stop its workers."""
        self.stream.close()
        await self._stopped.wait()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._stopped.is_set():
            raise RuntimeError("the trainer's worker pool has stopped")

    async def _on_rows(self, rows: list[dict[str, Any]], info: Any) -> None:
        head, _, rest = str(info.task_id).partition("|")
        step, index = int(head[1:]), int(rest.partition("|")[0])
        row = rows[0] if rows else {}
        refs = [r if isinstance(r, ShardRef) else ShardRef.from_json(r) for r in row.get("refs") or ()]
        collector = self._steps.get(step)
        if collector is None:
            # The step was abandoned (its next_batch cancelled): nobody will clear these.
            local = [r.shard_id for r in refs if r.owner == self.store.address]
            if local:
                await trio.to_thread.run_sync(self.store.remove, local)
            return
        group_size = self.config.group_size
        collector.summary["tasks"] += 1
        collector.summary["retried_tasks"] += bool(info.retried)
        if row.get("error") or "refs" not in row:  # the job raised, or its worker kept dying
            collector.summary["failed_tasks"] += 1
            collector.slots[index] = (row.get("task_id"), [], (0.0,) * group_size, group_size)
        else:
            collector.slots[index] = (row["task_id"], refs, tuple(row["rewards"]), row["errors"])
        collector.missing -= 1
        if not collector.missing:
            collector.done.set()
