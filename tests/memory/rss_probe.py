"""A lowwater plugin for test_eval_workers_rss.py: each env worker's RSS after its rollouts.

Loaded into every process of ``lowwater eval`` by ``LOWWATER_PLUGINS=rss_probe``
with this directory on ``PYTHONPATH`` (nothing is installed).  Settings come
from the environment, which the workers inherit:

* ``LOWWATER_RSS_PROBE_DIR``: where each process that ran rollouts writes
  ``PID.json`` at ``shutdown``: ``rollouts``, and its RSS in bytes at
  ``warm`` (after ``LOWWATER_RSS_PROBE_WARM`` rollouts) and ``end``.
  Both are read after ``gc.collect()`` and ``malloc_trim``, as the eval
  measures its resting RSS, so they compare live data, not the allocator's
  free lists (tests/memory/test_trim_rss.py gates the trim itself).
* ``LOWWATER_RSS_PROBE_LEAK`` (bytes, default 0): the failing control.
  Every finished rollout's trajectory and that many bytes (an agent's
  request body with a screenshot) are kept for the life of the process,
  the peer leak of docs/design.md#incidents.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import orjson

from lowwater.hookspecs import hookimpl
from lowwater.memory import Trimmer, rss_bytes

WARM = int(os.environ.get("LOWWATER_RSS_PROBE_WARM", "32"))
LEAK = int(os.environ.get("LOWWATER_RSS_PROBE_LEAK", "0"))
KEPT: list = []
figures: dict[str, int] = {"rollouts": 0}


def resting_rss() -> int:
    gc.collect()
    Trimmer(0.0)()
    return rss_bytes()


@hookimpl
async def rollout_end(rollout):
    figures["rollouts"] += 1
    if LEAK:
        KEPT.append((rollout.trajectory, b"\x01" * LEAK))
    if figures["rollouts"] == WARM:
        figures["warm"] = resting_rss()


@hookimpl
async def shutdown():
    if figures["rollouts"] == 0:
        return  # the eval's parent process: its workers ran the rollouts
    figures["end"] = resting_rss()
    figures["pid"] = os.getpid()
    out = Path(os.environ["LOWWATER_RSS_PROBE_DIR"]) / f"{os.getpid()}.json"
    out.write_bytes(orjson.dumps(figures))
