"""Built-in cleanup policies, registered as an ordinary plugin.

Each policy acts at lifecycle points through methods named after the hooks
(see :mod:`lowwater.hookspecs`).  ``lowwater.plugins.Plugins.fire`` runs them
after the plugins' own hook implementations, so a ``group_end`` hook still
sees the group's trajectories before eviction.

* ``trajectory-eviction`` — ungrouped trajectories at rollout end, grouped
  ones at group end (after the group reward).  The engine checks afterwards
  and evicts anything a disabled policy left, so disabling it cannot leak.
* ``intercept-sweep`` — unregisters the rollout's interception slot at
  rollout end (idempotent: the engine's close already did, this is the
  second line) and, on worker ticks, discards intercepts held longer than
  ``stale_after_s``: no model call legitimately lasts that long, and a stuck
  handler must not pin a request body for the rest of the run.
* ``malloc-trim`` — guarded ``malloc_trim(0)`` off the event loop after
  rollouts, groups, steps and at shutdown, rate-limited
  (:class:`lowwater.memory.Trimmer`).
* ``rss-sampling`` — appends current RSS to the run's memory record on
  every worker tick.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from lowwater.hookspecs import hookimpl
from lowwater.memory import Trimmer, rss_bytes

log = logging.getLogger("lowwater.cleanup")


class TrajectoryEviction:
    """Evict trajectories at rollout end (ungrouped) or group end (grouped)."""

    async def rollout_end(self, rollout: Any) -> None:
        registry = getattr(rollout, "registry", None)
        if registry is not None:
            registry.close_rollout(rollout.rollout_id)

    async def group_end(self, group: Any) -> None:
        group.registry.close_group(group.group_id)


class InterceptSweep:
    """Sweep a rollout's undelivered intercepts and, periodically, stale ones.

    Args:
        stale_after_s: an intercept held longer than this (seconds) is
            discarded on a worker tick and logged.
    """

    def __init__(self, stale_after_s: float = 3600.0) -> None:
        self.stale_after_s = stale_after_s
        self.swept = 0

    async def rollout_end(self, rollout: Any) -> None:
        interceptor = getattr(rollout, "interceptor", None)
        if interceptor is not None:
            self.swept += interceptor.unregister(rollout.rollout_id)

    async def worker_tick(self, stats: dict[str, Any]) -> None:
        table = stats.get("intercept_table")
        if table is None:
            return
        stale = table.stale(self.stale_after_s)
        for request_id in stale:
            if table.discard(request_id):
                self.swept += 1
        if stale:
            log.warning("discarded %d intercepts held for over %.0f s", len(stale), self.stale_after_s)


class MallocTrim:
    """Guarded, rate-limited ``malloc_trim(0)`` in a worker thread."""

    def __init__(self, min_interval_s: float = 1.0) -> None:
        self.trimmer = Trimmer(min_interval_s)

    async def _trim(self) -> None:
        # ctypes releases the GIL for the call, so a thread really takes it
        # off the loop; trimming walks every arena and can take milliseconds.
        await trio.to_thread.run_sync(self.trimmer)

    async def rollout_end(self, rollout: Any) -> None:
        await self._trim()

    async def group_end(self, group: Any) -> None:
        await self._trim()

    async def step_end(self, step: int, shard_ids: list[str]) -> None:
        await self._trim()

    async def shutdown(self) -> None:
        self.trimmer.min_interval_s = 0.0
        await self._trim()


class RssSampling:
    """Append current RSS to the run's :class:`lowwater.memory.MemoryRecord`."""

    async def worker_tick(self, stats: dict[str, Any]) -> None:
        record = stats.get("memory_record")
        if record is not None:
            record.add(stats.get("rss_bytes") or rss_bytes(), stats.get("finished", 0))


@hookimpl
def register_cleanup_policies(register: Any) -> None:
    # Fresh instances per plugin load: a policy's counters belong to one run.
    register("trajectory-eviction", TrajectoryEviction())
    register("intercept-sweep", InterceptSweep())
    register("malloc-trim", MallocTrim())
    register("rss-sampling", RssSampling())
