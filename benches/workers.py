"""The env worker pool: worker start-up cost, and worker RSS over a churn of
rollout-shaped tasks with and without allocator hygiene.

The incident (docs/design.md#incidents): a 30-worker evaluation was OOM-killed
after five hours under 8 GiB; its workers never recycled, and the fix's
spawned replacements lost copy-on-write sharing and restarted all at once.
This bench measures, in one run:

* **start** — ``--start-workers`` workers started from the lean forkserver
  (once cold, which boots the forkserver, then warm, as recycled workers
  start) and, for comparison, with ``spawn`` (a fresh interpreter per
  worker that also imports the parent's ``__main__``, this script): median
  time from start to ready (workers start together, so later ones queue),
  and each fresh worker's USS/PSS (memory it does not share);
* **churn** — ``--workers`` workers run ``--rollouts`` toy rollouts,
  ``--concurrency`` at a time per worker.  A toy rollout has ``--turns``
  turns; each turn appends a base64 image (``--image-kb`` before encoding)
  to its history and builds a request body carrying the whole history (as
  the incident's agents sent it), then drops the body.  No recycling (a
  long-lived worker's own discipline is measured), three times: with the
  pool's allocator hygiene (``M_ARENA_MAX`` 2 and ``M_TRIM_THRESHOLD``
  128 KiB via mallopt, ``gc`` + ``malloc_trim`` off the loop when a worker
  goes idle); the same with the trim threshold left to glibc
  (``malloc_trim_threshold="off"``: glibc's dynamic mmap threshold stays
  on); and with none of it (the peers' workers).  Setting a trim threshold
  switches the dynamic mmap threshold off, so every block of 128 KiB or
  more is mapped and faulted in afresh: memory goes back at once, at a CPU
  cost this workload (large buffers built per turn) shows as rollouts/s.

Every ``--sample-every`` rollouts the bench holds its ``on_rows`` until
every worker is idle and settled (collected and trimmed) and samples each
worker's resting RSS; the slope is a least-squares fit of resting RSS
against the worker's finished rollouts over the second half of those
samples, worst worker.  Peak is the largest RSS sampled every 50 ms.  The
live set is the largest number of bytes the job itself held at once (the
histories and request bodies of in-flight rollouts), worst worker.

Usage: ``python benches/workers.py [--quick] [--workers 2] [--concurrency 4]
[--turns 45] [--image-kb 150] [--rollouts 1000] [--sample-every 50]
[--start-workers 4]``.  The last line of stdout is the JSON object
described in benches/README.md#output.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import psutil
import trio

from _common import MIB, emit, params_of, progress, settle_and_sample, slope_bytes_per_rollout, target
from _common import pid_rss_bytes as _rss
from lowwater.workers import JobSpec, WorkerJob, WorkerPool

# Workers import this file by module name (they never import __main__).
FACTORY = f"{Path(__file__).stem}:ChurnJob"


class ChurnJob(WorkerJob):
    """Toy rollouts with the incident's allocation shape (see the module docstring).

    ``run("probe")`` returns at once (the start phase).
    """

    def __init__(self, turns: int = 45, image_kb: int = 150, turn_s: float = 0.002, seed: int = 0) -> None:
        self.turns = turns
        self.turn_s = turn_s
        self.block = os.urandom(image_kb * 1024)
        self.live = 0
        self.live_peak = 0
        self.finished = 0

    def stats(self) -> dict[str, Any]:
        return {"live_bytes": self.live, "live_peak_bytes": self.live_peak, "finished": self.finished}

    async def run(self, task_id: Any, attempt: int) -> list[dict[str, Any]]:
        if task_id == "probe":
            return [{"task_id": task_id, "pid": os.getpid()}]
        history: list[bytes] = []
        try:
            for _ in range(self.turns):
                image = base64.b64encode(self.block)  # a fresh ~200 KB object per turn
                history.append(image)
                body = b"".join(history)  # the request: the whole history again
                self.live += len(image) + len(body)
                self.live_peak = max(self.live_peak, self.live)
                await trio.sleep(self.turn_s)
                self.live -= len(body)
                del body
        finally:
            self.live -= sum(map(len, history))
            history.clear()
        self.finished += 1
        return [{"task_id": task_id, "turns": self.turns}]


async def start_phase(method: str, n: int) -> dict[str, float]:
    """Start ``n`` workers with ``method``; median start-to-ready and fresh USS/PSS."""
    ready: list[dict] = []
    gate = trio.Event()

    def on_event(name: str, fields: dict) -> None:
        if name == "ready":
            ready.append(fields)
            if len(ready) == n:
                gate.set()

    mem: dict[int, Any] = {}

    async def on_rows(rows: list[dict], info: Any) -> None:
        # Measure once every worker is up (their start-up work is done).
        with trio.move_on_after(60):
            await gate.wait()
        pid = rows[0]["pid"]
        if pid not in mem:
            mem[pid] = psutil.Process(pid).memory_full_info()

    pool = WorkerPool(
        JobSpec(FACTORY, {"turns": 1, "image_kb": 1}),
        workers=n,
        concurrency_per_worker=1,
        max_tasks_per_worker=None,
        start_method=method,
        on_event=on_event,
        heartbeat_s=0.2,
    )
    await pool.run(["probe"] * n, on_rows)
    starts = sorted(f["start_s"] for f in ready)
    return {
        "start_median_ms": 1000 * statistics.median(starts),
        "start_max_ms": 1000 * starts[-1],
        "uss_mb": statistics.fmean(m.uss for m in mem.values()) / MIB,
        "pss_mb": statistics.fmean(m.pss for m in mem.values()) / MIB,
        "rss_mb": statistics.fmean(m.rss for m in mem.values()) / MIB,
    }


async def churn_phase(a: argparse.Namespace, variant: str) -> dict[str, float]:
    """``variant``: ``hygiene`` (the pool's defaults), ``dynamic`` (the same
    but glibc's trim threshold, hence its dynamic mmap threshold, left
    alone) or ``bare`` (no allocator settings, no gc or trim at idle)."""
    hygiene = variant != "bare"
    baseline: dict[int, int] = {}
    peak: dict[int, int] = {}
    resting: dict[int, list[tuple[int, int]]] = {}
    delivered = 0

    def on_event(name: str, fields: dict) -> None:
        if name == "ready":
            baseline[fields["pid"]] = fields["rss"]

    pool = WorkerPool(
        JobSpec(FACTORY, {"turns": a.turns, "image_kb": a.image_kb, "turn_s": a.turn_s}),
        workers=a.workers,
        concurrency_per_worker=a.concurrency,
        max_tasks_per_worker=None,
        allocator_hygiene=hygiene,
        trim_at_quiescence=hygiene,
        gc_at_quiescence=hygiene,
        malloc_trim_threshold="off" if variant == "dynamic" else None,
        heartbeat_s=0.05,
        trim_interval_s=0.05,
        on_event=on_event,
    )

    async def on_rows(rows: list[dict], info: Any) -> None:
        nonlocal delivered
        delivered += 1
        if delivered % a.sample_every == 0 or delivered == a.rollouts:
            await settle_and_sample(pool, resting)

    async def sampler() -> None:
        while True:
            for w in pool.stats()["workers"].values():
                rss = _rss(w["pid"]) if w["pid"] else None
                if rss is not None:
                    peak[w["pid"]] = max(peak.get(w["pid"], 0), rss)
            await trio.sleep(0.05)

    live_peak = 0

    async def live_watch() -> None:
        nonlocal live_peak
        while True:
            for w in pool.stats()["workers"].values():
                live_peak = max(live_peak, int(w["job"].get("live_peak_bytes", 0) or 0))
            await trio.sleep(0.05)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler)
        nursery.start_soon(live_watch)
        report = await pool.run((f"r{i}" for i in range(a.rollouts)), on_rows)
        nursery.cancel_scope.cancel()
    wall = time.perf_counter() - started
    pids = list(baseline)
    growth_peak = max(peak.get(p, baseline[p]) - baseline[p] for p in pids)
    growth_rest = max(resting[p][-1][1] - baseline[p] for p in pids if resting.get(p))
    return {
        "rss_baseline_mb": statistics.fmean(baseline.values()) / MIB,
        "rss_peak_mb": max(peak.values()) / MIB,
        "rss_resting_mb": max(resting[p][-1][1] for p in pids if resting.get(p)) / MIB,
        "peak_over_baseline_mb": growth_peak / MIB,
        "resting_over_baseline_mb": growth_rest / MIB,
        "live_set_mb": live_peak / MIB,
        "rss_slope_bytes_per_rollout": max(slope_bytes_per_rollout(resting.get(p, [])) for p in pids),
        "rollouts_per_s": a.rollouts / wall,
        "retried_count": report.retried_tasks,
    }


async def bench(a: argparse.Namespace) -> tuple[dict, dict]:
    progress(f"start: {a.start_workers} workers, forkserver (cold, then warm) then spawn")
    cold = await start_phase("forkserver", a.start_workers)  # includes booting the forkserver
    fork = await start_phase("forkserver", a.start_workers)  # as recycled workers start
    spawn = await start_phase("spawn", a.start_workers)
    progress(
        f"churn: {a.rollouts} rollouts x {a.turns} turns x {a.image_kb} KB images, "
        f"{a.workers} workers x {a.concurrency}, with allocator hygiene"
    )
    good = await churn_phase(a, "hygiene")
    progress("churn: the same, glibc's trim (and dynamic mmap) threshold left alone")
    dynamic = await churn_phase(a, "dynamic")
    progress("churn: without allocator hygiene")
    bare = await churn_phase(a, "bare")
    results = {
        "forkserver_cold_start_max_ms": cold["start_max_ms"],
        "forkserver_start_median_ms": fork["start_median_ms"],
        "spawn_start_median_ms": spawn["start_median_ms"],
        "spawn_vs_forkserver_start_ratio": spawn["start_median_ms"] / fork["start_median_ms"],
        "forkserver_worker_uss_mb": fork["uss_mb"],
        "forkserver_worker_pss_mb": fork["pss_mb"],
        "spawn_worker_uss_mb": spawn["uss_mb"],
        "spawn_worker_pss_mb": spawn["pss_mb"],
        "spawn_vs_forkserver_uss_ratio": spawn["uss_mb"] / fork["uss_mb"],
        **{k: v for k, v in good.items()},
        **{f"dynamic_{k}": v for k, v in dynamic.items()},
        **{f"bare_{k}": v for k, v in bare.items()},
    }
    results["bare_vs_hygiene_rollouts_ratio"] = bare["rollouts_per_s"] / good["rollouts_per_s"]
    results["dynamic_vs_hygiene_rollouts_ratio"] = dynamic["rollouts_per_s"] / good["rollouts_per_s"]
    results["peak_over_live_set_ratio"] = (
        good["peak_over_baseline_mb"] / good["live_set_mb"] if good["live_set_mb"] else 0.0
    )
    targets = {
        "peak_over_live_set_ratio": target(results["peak_over_live_set_ratio"], max=3.0),
        "resting_over_baseline_mb": target(results["resting_over_baseline_mb"], max=16.0),
        "rss_slope_bytes_per_rollout": target(results["rss_slope_bytes_per_rollout"], max=1024.0),
    }
    return results, targets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="concurrent rollouts per worker")
    p.add_argument("--turns", type=int, default=45)
    p.add_argument("--image-kb", type=int, default=150)
    p.add_argument("--turn-s", type=float, default=0.002, help="simulated model latency per turn")
    p.add_argument("--rollouts", type=int, default=1000)
    p.add_argument("--sample-every", type=int, default=50, help="rollouts between resting samples")
    p.add_argument("--start-workers", type=int, default=4)
    a = p.parse_args()
    if a.quick:
        a.rollouts, a.turns, a.image_kb, a.sample_every, a.start_workers = 24, 6, 32, 4, 2
    results, targets = trio.run(bench, a)
    emit("workers", params_of(a), results, targets)


if __name__ == "__main__":
    main()
