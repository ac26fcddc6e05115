"""A pool owner that the test SIGKILLs (test_parent_death_leaves_no_orphans).

Starts a pool of two workers, one of them blocked in ``time.sleep`` (its
Trio loop cannot notice anything), prints ``{"workers": [pids],
"forkserver": pid}`` once both have a task, then waits to be killed.
"""

import json
import sys
from multiprocessing import forkserver
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from lowwater.workers import JobSpec, WorkerPool
from workers import jobs

busy: dict[int, int] = {}


def on_event(name, fields):
    if name == "dispatch":
        busy[fields["wid"]] = fields["pid"]
        if len(busy) == 2:
            print(
                json.dumps({"workers": sorted(busy.values()), "forkserver": forkserver._forkserver._forkserver_pid}),
                flush=True,
            )


async def on_rows(rows, info):
    pass


pool = WorkerPool(
    JobSpec(jobs.FACTORY),
    workers=2,
    concurrency_per_worker=1,
    heartbeat_s=0.2,
    heartbeat_timeout_s=600,
    orphan_grace_s=1.0,
    on_event=on_event,
)
trio.run(pool.run, ["block:600:99", "sleep:600"], on_rows)
