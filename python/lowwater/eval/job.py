"""The job an env worker process runs for ``lowwater eval --workers N``.

Each worker holds an engine (:class:`lowwater.assembly.EngineJob`) and runs
tasks by id; its rows go back to the parent, which writes them, so nothing
of a finished task stays in the worker (see docs/design.md#incidents, the
30-worker evaluation).
"""

from __future__ import annotations

from typing import Any

import trio

from lowwater.assembly import EngineJob
from lowwater.eval.samples import transcript
from lowwater.rollout import Rollout


class EvalJob(EngineJob):
    """Rollouts of one eval's environment, by task id.

    Args:
        config: :meth:`lowwater.assembly.EngineConfig.to_json` of the parent's settings.
        upstream_url: the model server's base URL (ends in ``/v1``).
        samples: add each rollout's transcript to its row under ``"sample"``
            (the parent writes it to the samples file and drops it).
    """

    def __init__(self, config: dict[str, Any], upstream_url: str, *, samples: bool = False) -> None:
        super().__init__(config, upstream_url)
        self.samples = samples

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        """The rows of task ``task_id``: one per rollout (``group_size`` of them)."""
        assert self.engine is not None, "setup() has not run"
        task = self.env.task(task_id)
        rows: list[dict[str, Any]] = []

        async def on_result(rollout: Rollout) -> None:
            row = rollout.result()
            if self.samples:  # built while the engine still holds the trajectory
                row["sample"] = transcript(rollout)
            rows.append(row)

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


def make_job(config: dict[str, Any], upstream_url: str, samples: bool = False) -> EvalJob:
    """The :class:`~lowwater.workers.JobSpec` factory."""
    return EvalJob(config, upstream_url, samples=samples)
