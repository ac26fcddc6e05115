"""The job an env worker process runs for ``lowwater eval --workers N``.

Each worker builds the environment from its name and options, starts its own
interception server and engine (:func:`lowwater.eval.open_engine`) against
the model server the parent started, and runs tasks by id: the parent keeps
task ids, never payloads, so a task whose worker died is re-run from its id
alone (DESIGN.md section 1, the 30-worker evaluation incident).

A worker's rows go back to the parent, which writes them; nothing of a
finished task stays in the worker.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from lowwater import plugins as plugins_mod
from lowwater.environment import Environment
from lowwater.eval import EvalConfig, open_engine
from lowwater.rollout import Engine, Rollout
from lowwater.workers import WorkerJob

log = logging.getLogger("lowwater.eval.worker")


class EvalJob(WorkerJob):
    """Rollouts of one eval's environment, by task id.

    Args:
        config: :meth:`EvalConfig.to_json` of the parent's config.
        upstream_url: the model server's base URL (ends in ``/v1``).
    """

    def __init__(self, config: dict[str, Any], upstream_url: str) -> None:
        self.config = EvalConfig.from_json(config)
        self.upstream_url = upstream_url
        self.engine: Engine | None = None
        self.server: Any = None
        self._stop = trio.Event()
        self._closed = trio.Event()

    async def setup(self) -> None:
        self.plugins = plugins_mod.load()
        self.env: Environment = self.plugins.environment(self.config.env)(self.config.env_options)
        # The engine's context (a nursery with the interception server) is
        # held open by a service task, not entered here: teardown runs under
        # its own cancel scope, and exiting a nursery there that setup had
        # entered corrupts Trio's scope stack (found on the first pooled run).
        await self.nursery.start(self._hold)

    async def _hold(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with open_engine(self.config, self.env, self.plugins, self.upstream_url) as (engine, server):
                self.engine, self.server = engine, server
                task_status.started()
                await self._stop.wait()
        finally:
            self._closed.set()

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        """The rows of task ``task_id``: one per rollout (``group_size`` of them)."""
        assert self.engine is not None, "setup() has not run"
        task = self.env.task(task_id)
        rows: list[dict[str, Any]] = []

        async def on_result(rollout: Rollout) -> None:
            rows.append(rollout.result())

        try:
            if self.config.group_size == 1:
                await self.engine.run_rollout(task, on_result=on_result)
            else:
                await self.engine.run_group(task, self.config.group_size, on_result=on_result)
        except trio.Cancelled:
            # Pool shutdown (Ctrl-C): the engine wrote its "cancelled" rows;
            # deliver those rather than the pool's one generic row per task.
            if rows:
                return rows
            raise
        return rows

    def stats(self) -> dict[str, Any]:
        """Heartbeat extras: the engine's live counts and the intercept table's."""
        if self.engine is None:
            return {}
        return {**self.engine.stats(), "intercepts": len(self.server.table)}

    async def tick(self, stats: dict[str, Any]) -> None:
        if self.engine is None:
            return
        await self.plugins.fire("worker_tick", stats={
            **stats, "intercepts": self.server.table.stats(), "intercept_table": self.server.table,
        })

    async def teardown(self) -> None:
        if self.engine is not None:
            await self.plugins.fire("shutdown")
            state = {**self.engine.stats(), "intercepts": len(self.server.table)}
            leftovers = {k: v for k, v in state.items() if v}
            if leftovers:  # every per-rollout structure should be empty here
                log.warning("worker ends with per-rollout state left: %s", leftovers)
        self._stop.set()
        await self._closed.wait()
        await self.env.aclose()


def make_job(config: dict[str, Any], upstream_url: str) -> EvalJob:
    """The :class:`~lowwater.workers.JobSpec` factory."""
    return EvalJob(config, upstream_url)
