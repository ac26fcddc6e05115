"""The job an env worker runs for the trainer API with ``workers > 0``.

Each worker runs whole groups (its own engine and interception server,
:class:`lowwater.assembly.EngineJob`), turns each finished group into shards
(:func:`lowwater.trainer.producer.group_shards`) and uploads them to the trainer
process's :class:`~lowwater.trainer.shards.ShardStore` (``PUT /shards/{id}``, raw
bytes).  The trainer process owns every shard: a worker that retires or
dies takes none of a step's data with it, and ``clear_batch`` has one owner
to clear.  The worker keeps nothing of a group after its row is returned.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from lowwater.assembly import EngineJob
from lowwater.rollout import Group
from lowwater.trainer.producer import group_shards
from lowwater.trainer.shards import DTYPE_HEADER, SHAPE_HEADER, ShardStore


class ShardUploadError(RuntimeError):
    """The trainer's shard store refused a shard (full: 507, or bad: 400)."""


class TrainerJob(EngineJob):
    """Groups by task, their shards uploaded to the trainer's store.

    Args:
        config: :meth:`lowwater.assembly.EngineConfig.to_json` of the worker's engine settings.
        upstream_url: the model server's base URL (ends in ``/v1``).
        store_url: the trainer's shard store (``http://host:port``).
        step: the trainer step (part of every group and shard id).
        request_logprobs: ask the upstream for token ids and logprobs.
    """

    def __init__(
        self, config: dict[str, Any], upstream_url: str, store_url: str, step: int, request_logprobs: bool = True
    ) -> None:
        super().__init__(config, upstream_url, request_logprobs=request_logprobs)
        self.store_url = store_url.rstrip("/")
        self.step = step
        self._uploads: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def resources(self) -> AsyncIterator[None]:
        """The HTTP client that uploads shards, held with the engine."""
        async with httpx.AsyncClient(timeout=self.config.timeout_s) as uploads:
            self._uploads = uploads
            yield

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        """``task_id`` is ``"s{STEP}|INDEX|JSON_TASK_ID"``
        (:func:`lowwater.trainer.pooled.task_key`; ``"INDEX|JSON_TASK_ID"``
        runs at the job's ``step``); one row with ``refs``, ``rewards`` and
        ``errors``."""
        assert self.engine is not None, "setup() has not run"
        text = str(task_id)
        step = self.step
        if text.startswith("s"):
            head, _, text = text.partition("|")
            step = int(head[1:])
        index, _, raw = text.partition("|")
        task = self.env.task(orjson.loads(raw))
        group_id = f"s{step}-g{index}"
        local = ShardStore()
        refs: list[dict[str, Any]] = []

        async def produce(group: Group) -> None:
            # Before group_end and eviction: the trajectories are still live.
            trajectories = {t.rollout_id: t for t in group.trajectories()}
            for ref in group_shards(local, f"step{step}/{group.group_id}", group.rollouts, trajectories):
                refs.append(await self._upload(local, ref.shard_id, ref.dtype, ref.shape))

        try:
            group = await self.engine.run_group(task, self.config.group_size, on_group=produce, group_id=group_id)
        finally:
            local.buffer.clear()
        return [
            {
                "task_id": task.id,
                "index": int(index),
                "refs": refs,
                "rewards": [r.reward or 0.0 for r in group.rollouts],
                "errors": sum(r.error is not None for r in group.rollouts),
            }
        ]

    async def _upload(self, local: ShardStore, shard_id: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
        """PUT one shard to the trainer's store, then drop the local copy."""
        assert self._uploads is not None
        view = local.buffer.get(shard_id)
        assert view is not None
        response = await self._uploads.put(
            f"{self.store_url}/shards/{quote(shard_id, safe='')}",
            content=bytes(memoryview(view)),
            headers={DTYPE_HEADER: dtype, SHAPE_HEADER: ",".join(map(str, shape))},
        )
        del view
        local.remove([shard_id])
        if response.status_code != 201:
            raise ShardUploadError(f"the trainer's shard store answered {response.status_code}: {response.text[:200]}")
        ref: dict[str, Any] = response.json()
        return ref


def make_job(**kwargs: Any) -> TrainerJob:
    """The :class:`~lowwater.workers.JobSpec` factory."""
    return TrainerJob(**kwargs)
