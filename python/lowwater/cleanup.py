"""Built-in cleanup policies, registered as an ordinary plugin.

Each policy acts at lifecycle points through methods named after the hooks
(see :mod:`lowwater.hookspecs`).  The engine runs them after the plugins'
own hook implementations and after its own eviction of the rollout's (or
group's) trajectories, so a trim finds them freed.

Policies do only what nothing else does: the engine alone releases a
rollout's slot, intercepts, runtime and trajectory (docs/memory-contract.md),
so disabling this plugin cannot leak them.

* ``intercept-sweep`` — on worker ticks, discards intercepts held longer
  than ``stale_after_s``: no model call legitimately lasts that long, and a
  stuck handler must not pin a request body for the rest of the run.
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


class InterceptSweep:
    """Discard stale intercepts on worker ticks (a rollout's own are swept by
    the engine when it unregisters the rollout's slot).

    Args:
        stale_after_s: an intercept held longer than this (seconds) is
            discarded on a worker tick and logged.

    Attributes:
        swept: intercepts discarded so far.
    """

    def __init__(self, stale_after_s: float = 3600.0) -> None:
        self.stale_after_s = stale_after_s
        self.swept = 0

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
    register("intercept-sweep", InterceptSweep())
    register("malloc-trim", MallocTrim())
    register("rss-sampling", RssSampling())
